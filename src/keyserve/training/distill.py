"""``keyserve distill-draft``: prompts -> target answers -> pruned vocabulary -> trained draft.

``--out DIR`` is both the draft directory and the work directory: the target's answers are
cached under ``DIR/data/`` and training checkpoints go to ``DIR/checkpoint.pt`` (both listed in
``DIR/.gitignore``), so ``--resume`` neither regenerates data nor restarts training. The time
budget is split: about a third for generation, the rest for training.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from keyserve.config import EngineConfig
from keyserve.core.sampling_params import MAX_TOP_LOGPROBS
from keyserve.engine.llm_engine import LLMEngine
from keyserve.model.draft_model import DRAFT_META_FILE, DraftMeta, embedding_checksum, tokenizer_fingerprint
from keyserve.model.loader import LoadedModel, load_model
from keyserve.model.paths import DEFAULT_MODEL_NAME
from keyserve.training.corpus import Item, record_corpus, teacher_force
from keyserve.training.dense import DenseLlama
from keyserve.training.engine_answers import engine_answers, engine_teacher_force
from keyserve.training.export import export_draft, import_draft
from keyserve.training.generate import GenerationJob, generate_answers
from keyserve.training.prompts import PROMPT_SETS, build_prompts, story_prompts
from keyserve.training.records import Answer, TeacherData, load_parts, recorded_top_k
from keyserve.training.threads import ThreadTuner
from keyserve.training.train import TRAIN_DTYPES, Checkpoint, TrainConfig, TrainResult, train_draft
from keyserve.training.vocab import coverage, index_map, select_vocab

GITIGNORE = "checkpoint.pt\ncheckpoint.tmp\ndata/\n*.tmp\n"
# Generation is the bottleneck (one full target forward per recorded token, ~20 tokens/s on 2
# shared cores), and the draft overfits small data, so it gets close to half the budget.
EXPORT_RESERVE_S = 60.0  # kept back from training for the final evaluation and export
HELDOUT_SHARE = 0.05


@dataclass
class DistillOptions:
    out: str
    target: str | None = None
    layers: int = 2
    init_layers: str | None = None  # "0,29"; default: evenly spaced, first and last included
    vocab: int = 8192
    num_prompts: int = 768
    gen_tokens: int = 192
    temperature: float = 0.8
    greedy_fraction: float = 0.25
    teacher_top_k: int = 32
    steps: int = 3000
    batch_tokens: int = 2048
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2
    resume: bool = False
    time_budget_min: float = 50.0
    gen_slots: int = 48
    gen_share: float = 0.45  # of the time budget, for the target's answers
    dropout: float = 0.1
    corpus_tokens: int = 0  # teacher-forced tokens of offline text (training/corpus.py); 0: none
    corpus_share: float = 0.2  # of the time budget, for them (after the answers)
    answer_rounds: int = 1  # answers per prompt: rounds after the first sample at `temperature`
    init_from: str | None = None  # another run's checkpoint.pt: start from its best weights
    keep: str = "best"  # export the best held-out evaluation's weights, or the "last" step's
    generator: str = "dense"  # answers by the float32 dense loop ("dense") or keyserve's engine
    gen_dtype: str = "bfloat16"  # the engine's dtype with generator "engine"
    with_data: str | None = None  # "DIR,DIR": earlier runs whose data/ parts are trained on too
    train_dtype: str = "float32"  # the training matmuls' dtype (train.TrainConfig.train_dtype)
    argmax_weight: float = 0.0  # + this x cross-entropy at the target's argmax (train.TrainConfig)
    prompt_set: str = "wide"  # prompts.PROMPT_SETS: "base" (runs 1-7's ~3.5k prompts) or "wide" (~20k)

    def extra_data_dirs(self) -> list[Path]:
        """The ``data/`` directories ``--with-data`` names, in order."""
        if not self.with_data:
            return []
        return [Path(d.strip()).expanduser() / "data" for d in self.with_data.split(",") if d.strip()]

    def __post_init__(self) -> None:
        """Every option in range, and ``out`` a directory path: a ValueError naming the
        ``distill-draft`` flag, before the output directory or anything else is touched (these
        used to surface only after the target loaded or its answers were generated, and
        ``out=""`` wrote into the current directory)."""
        if not str(self.out).strip():
            raise ValueError("--out must name a directory")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a directory")
        at_least = {"layers": 1, "vocab": 1, "num_prompts": 1, "gen_tokens": 1, "teacher_top_k": 1,
                    "gen_slots": 1, "corpus_tokens": 0, "answer_rounds": 1, "steps": 1, "batch_tokens": 1, "threads": 1, "seed": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, not {getattr(self, name)}")
        for name in ("greedy_fraction", "gen_share", "corpus_share", "dropout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0) or (name == "dropout" and value == 1.0):
                raise ValueError(f"--{name.replace('_', '-')} must lie in [0, 1{')' if name == 'dropout' else ']'}, "
                                 f"not {value}")
        if self.gen_share + self.corpus_share > 1.0:
            raise ValueError(f"--gen-share + --corpus-share must be at most 1, not {self.gen_share + self.corpus_share}")
        for name in ("lr", "time_budget_min"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, not {value}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a number >= 0, not {self.temperature}")
        if self.generator not in ("dense", "engine"):
            raise ValueError(f"--generator must be dense or engine, not {self.generator!r}")
        if self.gen_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--gen-dtype must be bfloat16 or float32, not {self.gen_dtype!r}")
        if self.generator == "engine" and self.teacher_top_k > MAX_TOP_LOGPROBS:
            raise ValueError(f"--generator engine records at most {MAX_TOP_LOGPROBS} alternatives per token "
                             f"(its top_logprobs): pass --teacher-top-k {MAX_TOP_LOGPROBS} or less")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"--prompt-set must be one of {', '.join(PROMPT_SETS)}, not {self.prompt_set!r}")
        if self.keep not in ("best", "last"):
            raise ValueError(f"--keep must be best or last, not {self.keep!r}")
        if not (math.isfinite(self.argmax_weight) and self.argmax_weight >= 0):
            raise ValueError(f"--argmax-weight must be a number >= 0, not {self.argmax_weight}")
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"--train-dtype must be one of {', '.join(TRAIN_DTYPES)}, not {self.train_dtype!r}")
        if self.init_from is not None and not (Path(self.init_from).is_file()
                                               or (Path(self.init_from) / DRAFT_META_FILE).is_file()):
            raise ValueError(f"--init-from {self.init_from} is neither a run's checkpoint.pt nor a draft directory")
        for data_dir in self.extra_data_dirs():
            if not any(data_dir.glob("part-*.safetensors")):
                raise ValueError(f"--with-data {data_dir.parent} holds no recorded data ({data_dir}/part-*.safetensors)")
            if data_dir.parent.resolve() == out.resolve():
                raise ValueError(f"--with-data {data_dir.parent} is --out itself: its data is this run's own")
            widths = recorded_top_k(data_dir) - {self.teacher_top_k}
            if widths:
                raise ValueError(f"--with-data {data_dir.parent} recorded top-{min(widths)}; this run records "
                                 f"top-{self.teacher_top_k} (--teacher-top-k must match)")
        if self.init_layers is not None:
            if not all(x.strip().isdigit() for x in self.init_layers.split(",")):
                raise ValueError(f"--init-layers must be comma-separated layer numbers, not {self.init_layers!r}")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> DistillOptions:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def init_layer_ids(layers: str | None, num_layers: int, target_layers: int) -> list[int]:
    """Target layers to copy: ``layers`` ("0,29"), else evenly spaced from first to last."""
    if layers:
        ids = [int(x) for x in layers.split(",")]
        if len(ids) != num_layers:
            raise ValueError(f"--init-layers names {len(ids)} layers but --layers is {num_layers}")
    elif num_layers == 1:
        ids = [0]
    else:
        ids = [math.floor(i * (target_layers - 1) / (num_layers - 1) + 0.5) for i in range(num_layers)]
    bad = [i for i in ids if not 0 <= i < target_layers]
    if bad:
        raise ValueError(f"--init-layers {bad} outside the target's {target_layers} layers")
    return ids


def _encode_prompts(target: LoadedModel, n: int, seed: int,
                    prompt_set: str = "base") -> tuple[list[list[int]], bool]:
    """Token ids of ``n`` prompts: chat-templated for chat models, plain stories otherwise."""
    tok = target.tokenizer
    if getattr(tok, "chat_template", None):
        out = []
        for text in build_prompts(n, seed, prompt_set):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out, True
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return [bos + tok.encode(t, add_special_tokens=False) for t in story_prompts(n, seed)], False


def _temperatures(n: int, opts: DistillOptions, round_: int = 0) -> list[float]:
    """Round 0: a share answered greedily; later rounds all sample (a greedy answer repeats)."""
    if round_ > 0:
        return [opts.temperature] * n
    rng = random.Random(opts.seed + 1)
    return [0.0 if rng.random() < opts.greedy_fraction else opts.temperature for _ in range(n)]


def _stop_ids(target: LoadedModel) -> set[int]:
    ids = set(target.config.eos_token_ids)
    if target.tokenizer.eos_token_id is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    return ids


class _Recorder:
    """Who records the target's distributions, as ``--generator`` says: the dense float32 model,
    or keyserve's engine, built once on first use and shared by every answer round and the
    teacher-forced text."""

    def __init__(self, target: LoadedModel, opts: DistillOptions) -> None:
        self.target, self.opts = target, opts
        self.dense = DenseLlama.from_serving(target.model)
        self._engine: LLMEngine | None = None

    def _the_engine(self) -> LLMEngine:
        if self._engine is None:
            config = EngineConfig.from_flat(model=str(self.target.path), dtype=self.opts.gen_dtype,
                                            max_num_seqs=self.opts.gen_slots, kv_cache_memory_gb=2.0,
                                            seed=self.opts.seed)
            self._engine = LLMEngine(config)
        return self._engine

    def answer(self, job: GenerationJob, deadline: float, save: Callable[[list[Answer]], None]) -> None:
        if self.opts.generator == "engine":
            engine_answers(self._the_engine(), job, deadline, save)
        else:
            generate_answers(self.dense, job, deadline, save, tuner=ThreadTuner(self.opts.threads))

    def force(self, items: list[Item], top_k: int) -> list[Answer]:
        if self.opts.generator == "engine":
            return engine_teacher_force(self._the_engine(), items, top_k)
        return teacher_force(self.dense, items, top_k)


def _generate(
    target: LoadedModel, recorder: _Recorder, out: Path, opts: DistillOptions, deadline: float
) -> TeacherData:
    """Answer the (prompt, round) pairs not answered yet (all of them on a fresh run) and return
    all data. Round r's answer to prompt i is recorded as prompt index ``r * num_prompts + i``:
    several sampled answers per prompt are more data once the prompt set is used up."""
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    have = load_parts(data_dir)
    done = set() if have is None else set(have.prompt_index.tolist())
    prompts, _ = _encode_prompts(target, opts.num_prompts, opts.seed, opts.prompt_set)
    n = len(prompts)
    for round_ in range(opts.answer_rounds):
        temps = _temperatures(n, opts, round_)
        todo = [i for i in range(n) if round_ * n + i not in done]
        if not todo or time.monotonic() >= deadline:
            continue
        save = _part_saver(data_dir, opts.teacher_top_k)
        job = GenerationJob(
            prompts=[prompts[i] for i in todo],
            temperatures=[temps[i] for i in todo],
            indices=[round_ * n + i for i in todo],
            max_new_tokens=opts.gen_tokens,
            stop_ids=_stop_ids(target),
            top_k=opts.teacher_top_k,
            slots=opts.gen_slots,
            seed=opts.seed + len(done) + round_ * 1_000_003,
        )
        recorder.answer(job, deadline, save)
    data = load_parts(data_dir)
    if data is None or data.num_tokens == 0:
        raise RuntimeError("the target produced no answers within the time budget")
    return data


def _part_saver(data_dir: Path, top_k: int) -> Callable[[list[Answer]], None]:
    """Saves each list of answers as the next ``part-NNNN.safetensors`` of ``data_dir``."""
    part = [len(list(data_dir.glob("part-*.safetensors")))]

    def save(answers: list[Answer]) -> None:
        path = data_dir / f"part-{part[0]:04d}.safetensors"
        TeacherData.from_answers(answers, top_k).save(path)
        part[0] += 1

    return save


def _record_corpus(target: LoadedModel, recorder: _Recorder, out: Path, opts: DistillOptions,
                   have: TeacherData, deadline: float) -> int:
    """Teacher-forced offline text (training/corpus.py) after the answers, up to
    ``opts.corpus_tokens`` tokens in all (``have``: the data on disk so far); returns the
    tokens recorded now."""
    already = _tokens_of(have, answers=False)
    if already >= opts.corpus_tokens:
        return 0
    passages = {i for i in have.prompt_index.tolist() if i < 0}
    return record_corpus(recorder.force, target.tokenizer, passages, _part_saver(out / "data", opts.teacher_top_k),
                         deadline, opts.corpus_tokens - already, opts.teacher_top_k, opts.seed)


def _with_extra_data(data: TeacherData, opts: DistillOptions) -> TeacherData:
    """``data`` followed by the ``--with-data`` runs' parts (so this run's own sequences keep
    their indices; those after them are the extra ones). ``DistillOptions`` checked, before
    anything was recorded, that each holds parts of this run's top-k."""
    extras = [load_parts(d) for d in opts.extra_data_dirs()]
    return TeacherData.concat([data, *extras]) if extras else data


def _split(data: TeacherData, seed: int, num_prompts: int | None = None,
           own: int | None = None) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices; held-out is ~5% of the target's answers (never
    teacher-forced text: agreement is measured where the draft serves), at least one. With
    ``num_prompts``, every answer to one prompt (all rounds) falls on the same side, so the
    held-out agreement never scores a prompt the draft trained on. Only the first ``own``
    sequences (this run's) can be held out: the rest came from earlier runs (``--with-data``),
    whose drafts (often the ``--init-from``) trained on them, so they would flatter it."""
    own = data.num_sequences if own is None else own
    order = list(range(own))
    random.Random(seed + 2).shuffle(order)
    answers = [i for i in order if int(data.prompt_index[i]) >= 0] or order
    if num_prompts:
        base = sorted({int(data.prompt_index[i]) % num_prompts for i in answers})
        random.Random(seed + 3).shuffle(base)
        held_base = set(base[: max(1, math.ceil(HELDOUT_SHARE * len(base)))])
        heldout = [i for i in answers if int(data.prompt_index[i]) % num_prompts in held_base]
    else:
        k = max(1, math.ceil(HELDOUT_SHARE * len(answers))) if len(order) > 1 else 0
        heldout = answers[:k]
    held = set(heldout)
    train = [i for i in order if i not in held] or order
    return train + list(range(own, data.num_sequences)), heldout or order[:1]


def _special_ids(target: LoadedModel) -> list[int]:
    tok = target.tokenizer
    ids = set(getattr(tok, "all_special_ids", []) or []) | _stop_ids(target)
    return sorted(int(i) for i in ids if i is not None)


def _head_ids(data: TeacherData, target: LoadedModel, opts: DistillOptions,
              source: dict | None) -> torch.Tensor:
    """The pruned vocabulary: the one ``source`` was trained with (the run's own checkpoint when
    resuming, another run's with ``--init-from``), else picked from the data."""
    if source is not None:
        return torch.tensor(source["identity"]["head_ids"], dtype=torch.int64)
    return select_vocab(data, target.config.vocab_size, opts.vocab, _special_ids(target))


def command_line(opts: DistillOptions) -> str:
    """The ``keyserve distill-draft`` call that reproduces ``opts`` (non-default flags only)."""
    parts = ["keyserve", "distill-draft"]
    for f in fields(opts):
        value = getattr(opts, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out" or value != f.default:
            if isinstance(value, bool):
                parts += [flag] if value else []
            else:
                parts += [flag, str(value)]
    return shlex.join(parts)


def distill_draft(opts: DistillOptions) -> Path:
    """Run the whole pipeline; returns the draft directory."""
    t0 = time.monotonic()
    budget_s = opts.time_budget_min * 60.0
    out = Path(opts.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text(GITIGNORE)
    own = out / "checkpoint.pt"
    if not opts.resume and (own.is_file() or any((out / "data").glob("part-*"))):
        raise ValueError(f"{out} holds an earlier run's data; pass --resume or use another --out")
    ThreadTuner(opts.threads)
    target = load_model(opts.target, torch.float32, "cpu")
    resuming = opts.resume and own.is_file()
    if resuming:
        data = load_parts(out / "data")  # training had started: the data is final
        if data is None:
            raise ValueError(f"{out}/checkpoint.pt exists but {out}/data/ is empty")
    else:
        recorder = _Recorder(target, opts)  # dropped before training: the engine's KV cache with it
        data = _generate(target, recorder, out, opts, t0 + opts.gen_share * budget_s)
        if opts.corpus_tokens > 0 and _record_corpus(
                target, recorder, out, opts, data, t0 + (opts.gen_share + opts.corpus_share) * budget_s):
            data = load_parts(out / "data") or data
        del recorder
    gen_s = time.monotonic() - t0
    own_sequences = data.num_sequences
    data = _with_extra_data(data, opts)
    init = None if resuming or opts.init_from is None else _load_checkpoint(Path(opts.init_from))
    head_ids = _head_ids(data, target, opts, _load_checkpoint(own) if resuming else init)
    head_map = index_map(head_ids, target.config.vocab_size)
    layer_ids = init_layer_ids(opts.init_layers, opts.layers, target.config.num_hidden_layers)
    draft = DenseLlama.from_serving(target.model, layer_ids, head_ids, trainable=True)
    if init is not None:
        _start_from(draft, init, layer_ids)
    rounds = opts.answer_rounds > 1 or int(data.prompt_index.max()) >= opts.num_prompts
    train_seqs, heldout_seqs = _split(data, opts.seed, opts.num_prompts if rounds else None, own_sequences)
    cfg = TrainConfig(
        max_steps=opts.steps,
        batch_tokens=opts.batch_tokens,
        lr=opts.lr,
        warmup_steps=max(1, min(20, opts.steps // 10)),
        time_budget_s=max(budget_s - (time.monotonic() - t0) - EXPORT_RESERVE_S, 1.0),
        seed=opts.seed,
        max_threads=opts.threads,
        dropout=opts.dropout,
        keep=opts.keep,
        train_dtype=opts.train_dtype,
        argmax_weight=opts.argmax_weight,
    )
    identity = {"layers": layer_ids, "head_ids": head_ids.tolist(), "target": str(target.path)}
    result = train_draft(
        draft, data, train_seqs, heldout_seqs, head_ids, head_map, cfg,
        Checkpoint(own, identity), opts.resume,
    )
    meta = DraftMeta(
        target=opts.target or DEFAULT_MODEL_NAME,
        target_vocab_size=target.config.vocab_size,
        hidden_size=target.config.hidden_size,
        tokenizer_sha256=tokenizer_fingerprint(target.tokenizer),
        shared_embeddings=True,
        lm_head_token_ids=head_ids.tolist(),
        embedding_checksum=embedding_checksum(target.model.model.embed_tokens.weight),
        training=_training_record(opts, data, layer_ids, head_ids, target, result, gen_s, t0),
    )
    export_draft(draft, meta, out)
    print(_summary(out, result, time.monotonic() - t0), file=sys.stderr)
    return out


def _load_checkpoint(path: Path) -> dict:
    """A run's ``checkpoint.pt``, or an exported draft directory read back into one's shape."""
    if path.is_dir():
        return import_draft(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _start_from(draft: DenseLlama, init: dict, layer_ids: list[int]) -> None:
    """Copy another run's best weights (``init``: its checkpoint) into ``draft`` (same layers and
    vocabulary): training on more data continues from where that run ended instead of from the
    target's layers."""
    if init["identity"]["layers"] != layer_ids:
        raise ValueError(f"--init-from was trained from layers {init['identity']['layers']}, not {layer_ids}")
    weights = init["best"]["weights"] or init["weights"]
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def _tokens_of(data: TeacherData, answers: bool) -> int:
    """Recorded tokens of the target's answers (prompt index >= 0) or of teacher-forced text."""
    lengths = data.gen_offsets[1:] - data.gen_offsets[:-1]
    return int(lengths[(data.prompt_index >= 0) == answers].sum())


def _training_record(
    opts: DistillOptions,
    data: TeacherData,
    layer_ids: list[int],
    head_ids: torch.Tensor,
    target: LoadedModel,
    result: TrainResult,
    gen_s: float,
    t0: float,
) -> dict[str, Any]:
    return {
        "command": command_line(opts),
        "options": asdict(opts),
        "init_layers": layer_ids,
        "data": {
            "sequences": data.num_sequences,
            "answer_tokens": _tokens_of(data, answers=True),
            "teacher_forced_tokens": _tokens_of(data, answers=False),
            "prompt_tokens": int(data.prompt_tokens.numel()),
            "teacher_top_k": int(data.topk_ids.shape[1]),
            "vocab_coverage": coverage(data, head_ids, target.config.vocab_size),
        },
        "steps": result.steps,
        "kept_step": result.kept_step,
        "train_tokens": result.train_tokens,
        "loss_first": result.first_loss,
        "loss_last": result.last_loss,
        "heldout_initial": asdict(result.initial_eval),
        "heldout_final": asdict(result.final_eval),
        "history": result.history,
        "seconds": {
            "generation_this_run": round(gen_s, 1),
            "training_total": round(result.train_seconds, 1),
            "wall_this_run": round(time.monotonic() - t0, 1),
        },
    }


def _summary(out: Path, result: TrainResult, wall_s: float) -> str:
    f, i = result.final_eval, result.initial_eval
    return (
        f"draft written to {out}: {result.steps} steps, held-out top-1 agreement "
        f"{i.top1:.3f} -> {f.top1:.3f}, KL {i.kl:.3f} -> {f.kl:.3f}, T=1 overlap "
        f"{f.overlap_t1:.3f}; wall {wall_s / 60:.1f} min"
    )
