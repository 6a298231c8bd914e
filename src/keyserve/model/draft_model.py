"""Loading a draft model for speculative decoding (docs/algorithms.md §3).

A draft is either

- a *keyserve draft directory* (``keyserve distill-draft`` writes one): a few Llama layers, a
  final norm and a **pruned LM head** over the tokens the target actually uses, plus
  ``keyserve_draft.json``. Its input embeddings are the target's, not stored: the loader
  reattaches the target's tensor (shared, no copy when dtype and device match). Logits are
  full-vocabulary, ``-inf`` outside the head's tokens, so the speculative rejection rule works
  unchanged (it is exact for any draft, including one with zero mass on some tokens);
- or a plain Hugging Face Llama directory with the target's vocabulary (e.g. stories260K
  drafting for itself in tests).

Either way ``load_draft`` returns a ``LoadedModel`` whose ``model`` has the serving API
(``forward`` over the paged KV cache, ``compute_logits`` -> ``[n, vocab]``), whose ``config``
sizes the draft's own KV cache, and whose tokenizer is the target's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from keyserve.model.config import ModelConfig
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.loader import LoadedModel, load_vocab
from keyserve.model.matmul import linear
from keyserve.model.paths import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
from keyserve.model.weights import iter_safetensors

__all__ = [
    "DRAFT_META_FILE",
    "DraftError",
    "DraftMeta",
    "PrunedHeadLlama",
    "default_draft_dir",
    "embedding_checksum",
    "load_draft",
    "resolve_draft_dir",
    "tokenizer_fingerprint",
]

DRAFT_META_FILE = "keyserve_draft.json"
DRAFT_FORMAT = "keyserve-draft"
DRAFT_FORMAT_VERSION = 1
# The committed drafts live next to the package in the repository: <repo>/drafts/<name>.
REPO_DRAFTS_DIR = Path(__file__).resolve().parents[3] / "drafts"
DEFAULT_DRAFTS = {DEFAULT_MODEL_NAME: "SmolLM2-135M-Instruct-draft"}
DEFAULT_DRAFT_ALIASES = ("default", "auto")


class DraftError(ValueError):
    """The draft cannot serve this target (vocabulary, tokenizer or shape mismatch)."""


@dataclass
class DraftMeta:
    """``keyserve_draft.json``: what the draft was distilled from and how to rebuild it."""

    target: str
    target_vocab_size: int
    hidden_size: int
    tokenizer_sha256: str
    shared_embeddings: bool
    lm_head_token_ids: list[int]  # full-vocabulary id of every LM-head row, ascending
    embedding_checksum: float | None = None
    training: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": DRAFT_FORMAT, "version": DRAFT_FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def read(cls, path: Path) -> DraftMeta:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if raw.get("format") != DRAFT_FORMAT or raw.get("version") != DRAFT_FORMAT_VERSION:
            raise DraftError(
                f"{path} is not a {DRAFT_FORMAT} v{DRAFT_FORMAT_VERSION} file "
                f"(format={raw.get('format')!r}, version={raw.get('version')!r})"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the token -> id table: equal fingerprints mean the same ids for every token."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def embedding_checksum(weight: torch.Tensor) -> float:  # weight: [vocab, hidden]
    """A cheap signature of the target's embedding (mean |w| of every 97th row), to warn when a
    draft is attached to a different model that happens to share the tokenizer."""
    return float(weight[::97].detach().double().abs().mean())


class SharedEmbedding(nn.Module):
    """The target's embedding, looked up but not owned: not a parameter of the draft (absent
    from ``state_dict`` and ``parameters()``), because the draft's files do not store it and
    its weight-read cost per token is one row."""

    def __init__(self, weight: torch.Tensor) -> None:  # [vocab, hidden]
        super().__init__()
        self.weight = weight.detach()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] long -> [n, hidden]
        return F.embedding(ids, self.weight)


class PrunedHeadLlama(LlamaForCausalLM):
    """A Llama decoder whose LM head holds rows for ``head_token_ids`` only.

    ``compute_logits`` returns full-vocabulary logits with ``-inf`` outside the subset;
    ``compute_head_logits`` the ``[n, N]`` subset logits for callers that can use them directly.
    """

    def __init__(
        self,
        config: ModelConfig,
        head_token_ids: torch.Tensor,  # [N] int64, ascending full-vocabulary ids
        embed_weight: torch.Tensor | None,  # [vocab, hidden] the target's, or None = own
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # Built tied so the base class allocates no full-vocabulary LM head; replaced below.
        super().__init__(dataclasses.replace(config, tie_word_embeddings=True), dtype, device)
        self.config = config
        if embed_weight is not None:
            self.model.embed_tokens = SharedEmbedding(embed_weight)
        self.register_buffer("head_token_ids", head_token_ids.to(device=device, dtype=torch.int64))
        self.lm_head_weight = nn.Parameter(
            torch.empty(head_token_ids.numel(), config.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    @property
    def shares_embeddings(self) -> bool:
        return isinstance(self.model.embed_tokens, SharedEmbedding)

    def compute_head_logits(
        self, hidden: torch.Tensor  # [n, hidden_size]
    ) -> torch.Tensor:  # [n, N] float32, column j is token head_token_ids[j]
        return linear(hidden, self.lm_head_weight).float()

    def compute_logits(
        self, hidden: torch.Tensor  # [n, hidden_size]
    ) -> torch.Tensor:  # [n, vocab_size] float32, -inf outside head_token_ids
        sub = self.compute_head_logits(hidden)
        out = torch.full(
            (hidden.shape[0], self.config.vocab_size), float("-inf"), device=sub.device
        )
        return out.index_copy_(1, self.head_token_ids, sub)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Layers and final norm by Hugging Face name, ``lm_head.weight`` as ``[N, hidden]``;
        ``model.embed_tokens.weight`` only when the embedding is not shared."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                if tuple(tensor.shape) != tuple(self.lm_head_weight.shape):
                    raise DraftError(
                        f"lm_head.weight has shape {tuple(tensor.shape)} but the draft lists "
                        f"{self.lm_head_weight.shape[0]} head tokens"
                    )
                self.lm_head_weight.copy_(tensor)
            elif name == "model.embed_tokens.weight" and self.shares_embeddings:
                raise DraftError("the draft stores embeddings but says it shares the target's")
            else:
                self._load_one(name, tensor)
            loaded.add(name)
        expected = set(self._expected_targets()) | {"lm_head.weight"}
        if self.shares_embeddings:
            expected.discard("model.embed_tokens.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise DraftError(f"draft checkpoint is missing weights: {missing[:8]}")
        # As the target does: row-major where the native kernels are built, so a draft decode
        # forward is one native call over its few layers (and its head one native product)
        # instead of the torch layers' per-layer overhead, which cost more than its weights.
        self._settle_layout()


def default_draft_dir(target_name: str = DEFAULT_MODEL_NAME) -> Path:
    """The draft committed in this repository for ``target_name``."""
    if target_name in DEFAULT_MODEL_ALIASES:
        target_name = DEFAULT_MODEL_NAME
    if target_name not in DEFAULT_DRAFTS:
        raise DraftError(f"no committed draft for {target_name!r}; build one with keyserve distill-draft")
    return REPO_DRAFTS_DIR / DEFAULT_DRAFTS[target_name]


def resolve_draft_dir(draft: str | Path) -> Path:
    """A draft directory from a path, ``"default"``/``"auto"`` (the committed draft of the
    default target) or a default target's name."""
    name = str(draft)
    if name in DEFAULT_DRAFT_ALIASES or name in DEFAULT_MODEL_ALIASES:
        path = default_draft_dir()
    else:
        path = Path(draft).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"draft {name!r}: {path} has no config.json; expected a keyserve draft directory "
            "(keyserve distill-draft --out DIR) or a Hugging Face Llama directory"
        )
    return path


def _target_device(target: LoadedModel) -> torch.device:
    return target.model.model.embed_tokens.weight.device


def _check_shapes(config: ModelConfig, target: LoadedModel, where: Path) -> None:
    t = target.config
    if config.vocab_size != t.vocab_size:
        raise DraftError(
            f"draft {where} has vocab_size {config.vocab_size} but the target has {t.vocab_size}: "
            "speculative sampling needs the draft's and target's token ids to be the same"
        )


def _check_tokenizer(fingerprint: str, target: LoadedModel, where: Path) -> None:
    if fingerprint != tokenizer_fingerprint(target.tokenizer):
        raise DraftError(
            f"draft {where} was built for a different tokenizer than the target's "
            f"({target.path}): the same token ids would mean different text"
        )


def _load_pruned(
    path: Path, meta: DraftMeta, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> PrunedHeadLlama:
    config = ModelConfig.from_file(path / "config.json")
    _check_shapes(config, target, path)
    if meta.target_vocab_size != target.config.vocab_size or meta.hidden_size != target.config.hidden_size:
        raise DraftError(
            f"draft {path} was distilled for {meta.target!r} (vocab {meta.target_vocab_size}, "
            f"hidden {meta.hidden_size}); the target has vocab {target.config.vocab_size}, "
            f"hidden {target.config.hidden_size}"
        )
    _check_tokenizer(meta.tokenizer_sha256, target, path)
    embed = None
    if meta.shared_embeddings:
        source = target.model.model.embed_tokens.weight
        if meta.embedding_checksum is not None:
            got = embedding_checksum(source)
            if abs(got - meta.embedding_checksum) > 1e-3 * abs(meta.embedding_checksum):
                warnings.warn(
                    f"draft {path} was distilled against {meta.target!r}, whose embeddings differ "
                    "from this target's: outputs stay exact, but acceptance may be poor",
                    stacklevel=3,
                )
        embed = source if (source.dtype, source.device) == (dtype, device) else source.to(device, dtype)
    ids = torch.tensor(meta.lm_head_token_ids, dtype=torch.int64)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise DraftError(f"draft {path}: lm_head_token_ids must be non-empty ids below {config.vocab_size}")
    net = PrunedHeadLlama(config, ids, embed, dtype, device)
    net.load_weights(iter_safetensors(path))
    return net.eval()


def _load_plain(
    path: Path, target: LoadedModel, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    config = ModelConfig.from_file(path / "config.json")
    _check_shapes(config, target, path)
    if any(path.glob("tokenizer*.json")) or (path / "tokenizer.model").is_file():
        _check_tokenizer(tokenizer_fingerprint(load_vocab(path)), target, path)
    net = LlamaForCausalLM(config, dtype, device)
    net.load_weights(iter_safetensors(path))
    return net.eval()


def load_draft(
    path: str | Path,
    target: LoadedModel,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load the draft at ``path`` for ``target`` (dtype and device default to the target's).

    Raises ``DraftError`` when the draft's vocabulary, tokenizer or hidden size cannot serve
    this target, ``FileNotFoundError`` when ``path`` is not a model directory."""
    directory = resolve_draft_dir(path)
    dtype = dtype or target.model.dtype
    device = torch.device(device) if device is not None else _target_device(target)
    meta_path = directory / DRAFT_META_FILE
    if meta_path.is_file():
        net: LlamaForCausalLM = _load_pruned(directory, DraftMeta.read(meta_path), target, dtype, device)
    else:
        net = _load_plain(directory, target, dtype, device)
    return LoadedModel(net, net.config, target.tokenizer, directory, dict(target.generation_config))
