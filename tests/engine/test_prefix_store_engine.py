"""The prefix store in the engine, on stories260K: a stored prefix pushed to disk loads back
with identical KV and output; importance loads hold exactly the important tokens at their
original positions and generate what attention over those tokens generates (a transformers
oracle); corrupt files are misses; preempted sequences feed the store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keyserve import LLM, SamplingParams

STORY = (
    "Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
    "One day she saw a big red ball and she wanted to play with it. She ran to the ball and kicked "
    "it very hard. The ball flew over the fence and into the garden of an old man."
)
OTHERS = [
    "Tom had a small dog called Max. Every morning they walked to the river together and watched "
    "the ducks swim. One day Max jumped into the water and Tom laughed and laughed.",
    "The sun was hot and the sky was blue. Sue and her mom went to the beach with a big bag of "
    "toys. They built a castle of sand and put a shell on the top of it.",
]
BLOCK = 8


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make(stories_path: str, tmp_path: Path | None = None, **store) -> LLM:
    kw = dict(num_blocks=160, block_size=BLOCK, enable_prefix_caching=False)
    if tmp_path is not None:
        kw.update(prefix_store=True, prefix_store_disk_path=str(tmp_path),
                  **{f"prefix_store_{k}": v for k, v in store.items()})
    return LLM(stories_path, **kw)


def gather(llm: LLM, table: list[int], slots: torch.Tensor) -> torch.Tensor:  # [L, n, 2, H, D]
    """K/V at logical ``slots`` of a block table, read straight from the cache (on the CPU,
    whichever device holds it: the oracles run there)."""
    t = torch.tensor(table)
    phys = t[slots // BLOCK] * BLOCK + slots % BLOCK
    return torch.stack([torch.stack([k.view(-1, *k.shape[2:])[phys], v.view(-1, *v.shape[2:])[phys]], 1)
                        for k, v in llm.engine.runner.kv_caches]).cpu()


def first_step(llm: LLM, ids: list[int], params: SamplingParams, whole_prompt: bool = True):
    """Admit and prefill one request (``whole_prompt``: every step of its prompt; else one
    step); returns (request id, its sequence)."""
    engine = llm.engine
    rid = engine.add_request(ids, params)
    engine.step()
    seq = engine.requests[rid].seqs[0]
    while whole_prompt and seq.num_computed_tokens < len(ids) and not seq.is_finished:
        engine.step()
    return rid, seq


def finish(llm: LLM, rid: str) -> list[int]:
    outs = llm.engine.run_until_done()
    return outs[rid].token_ids


@pytest.fixture(scope="module")
def ref(stories_path: str) -> LLM:
    return make(stories_path)


def test_off_by_default(ref: LLM) -> None:
    assert ref.engine.prefix_store is None and ref.engine.block_manager.on_free is None
    assert ref.engine.prefix_store_stats() == {}


def test_full_policy_prefix_pushed_to_disk_loads_back_identically(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    llm = make(stories_path, tmp_path, device_tokens=16, host_tokens=16)
    ids = llm.engine.encode_prompt(STORY)
    for text in [STORY] + OTHERS:  # the later prefixes push the first one out of memory
        llm.generate(text, greedy())
    ps = llm.engine.prefix_store
    store = ps.store
    node = store.tree.match(ids)[0].node
    keys = [(node.node_id, layer, c) for layer in range(5) for c in range(node.payload.num_chunks)]
    assert not any(k in store.index["device"] or k in store.index["host"] for k in keys)  # disk only
    before = dict(llm.engine.prefix_store_stats())
    rid, seq = first_step(llm, ids, greedy())
    st = llm.engine.prefix_store_stats()
    m = seq.num_cached_tokens
    assert m == len(ids) - len(ids) % BLOCK and m > 64
    assert st["disk_hits"] > before["disk_hits"] and st["device_hits"] == before["device_hits"]
    assert st["disk_bytes_read"] - before["disk_bytes_read"] == m * 5 * 4 * 8 * 2 * 4  # L*H*D*KV*fp32
    loaded = gather(llm, seq.block_table, torch.arange(m))
    rid_ref, seq_ref = first_step(ref, ids, greedy())
    recomputed = gather(ref, seq_ref.block_table, torch.arange(m))
    assert torch.equal(loaded, recomputed)  # identical KV
    assert finish(llm, rid) == finish(ref, rid_ref)  # identical greedy output
    llm.engine.close()


def importance_load(
    nd: object, m: int, recent_from: int, even: bool = False
) -> tuple[list[list[int]], list[int]]:
    """What an importance load of a stored node (``NodeData``) of ``m`` tokens brings per layer:
    the important positions, those of a "load all" layer, and the recent window (positions from
    ``recent_from`` on), ascending -- with ``even``, every layer topped up to the largest count
    with its next tokens in storage order -- and the stored chunks each layer reads for them."""
    wants = [nd.important[layer] | bool(nd.load_all[layer]) | (torch.arange(m) >= recent_from)
             for layer in range(nd.order.shape[0])]
    most = max(int(w.sum()) for w in wants)
    held, chunks = [], []
    inv = torch.argsort(nd.order, dim=1)  # logical -> storage index
    for layer, want in enumerate(wants):
        xs = want.nonzero().flatten().tolist()
        if even:
            rest = [int(x) for x in nd.order[layer] if not want[x]]
            xs = sorted(xs + rest[: most - len(xs)])
        held.append(xs)
        chunks.append(len({int(inv[layer, x]) // BLOCK for x in xs}))
    return held, chunks


def test_importance_load_equals_attention_over_the_same_tokens(stories_path: str, tmp_path: Path) -> None:
    """A request under H2O loads the important half of a stored prefix and the part of its recent
    window that lies in the prefix (no layer falls back here: the agreement check is off). Its KV
    slots hold exactly those tokens' recomputed K/V at their original positions, and its greedy
    output equals transformers generating over a cache of the same tokens per layer (the budget
    is large enough that H2O evicts nothing more). Dropping the recent window from the load, or
    storing the unimportant tokens in another order than latest first, fails it."""
    from transformers import DynamicCache, LlamaForCausalLM

    llm = make(stories_path, tmp_path, top_k_fraction=0.5, check_agreement=False)
    ids = llm.engine.encode_prompt(STORY)
    llm.generate([ids], greedy(1, kv_policy="h2o", kv_budget=0.5))  # computes and stores, with scores
    store = llm.engine.prefix_store.store
    assert store.stats.importance_layers == 5 and store.stats.importance_fallbacks == 0
    m = len(ids) - len(ids) % BLOCK
    suffix = llm.engine.encode_prompt(" Then she went home and had a nap.")[1:]
    prompt = ids[:m] + suffix
    rid, seq = first_step(llm, prompt, greedy(12, kv_policy="h2o", kv_budget=1000, recent_ratio=0.1))
    assert seq.num_cached_tokens == m
    # the recent window (w = 10 % of k, k capped by the context), of which the prefix holds the first part
    recent_from = len(prompt) - seq.kv_budget.num_recent
    assert 0 < recent_from < m - 2 * BLOCK
    state = llm.engine.runner.budget.states[seq.seq_id]
    pos = state.positions[:, 0].cpu()  # [L, slots]: loaded tokens, then the suffix
    nd = store.tree.match(prompt)[0].node.payload
    important = nd.important  # [L, m]
    assert bool((important.sum(1) == m // 2).all())
    held, chunks = importance_load(nd, m, recent_from, even=True)  # budget >= prompt: one count
    k = len(held[0])
    assert all(len(h) == k for h in held) and m // 2 < k < m  # the window adds unimportant tokens
    for layer in range(5):
        assert pos[layer, :k].tolist() == held[layer]
    assert pos[:, k:].equal(torch.arange(m, len(prompt)).expand(5, -1))
    chunk_bytes = BLOCK * 4 * 8 * 2 * 4  # tokens x kv-heads x head_dim x (K, V) x fp32
    # repacked: the important chunks, then the window's unimportant tokens, latest first
    assert chunks == [-(-k // BLOCK)] * 5
    assert store.stats.disk_bytes_read == sum(chunks) * chunk_bytes
    # KV of the loaded slots == recomputed KV at those positions, layer by layer
    ref = make(stories_path)
    rid_ref, seq_ref = first_step(ref, ids[:m] + [ids[m]], greedy(2))
    full = gather(ref, seq_ref.block_table, torch.arange(m))  # [L, m, 2, H, D]
    loaded = gather(llm, seq.block_table, torch.arange(k))
    # (the stored KV was computed by the H2O prefill, whose attention also returns scores: the
    # deeper layers differ from the plain path's in the last float bits; layer 0 is bitwise equal)
    assert torch.equal(loaded[0], full[0, pos[0, :k]])
    for layer in range(5):
        torch.testing.assert_close(loaded[layer], full[layer, pos[layer, :k]], atol=1e-5, rtol=1e-5)
    ours = finish(llm, rid)
    ref.engine.run_until_done()
    # the oracle: transformers over a cache holding the same tokens per layer
    hf = LlamaForCausalLM.from_pretrained(stories_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        prefix = hf(torch.tensor([ids[:m]]), use_cache=True).past_key_values
        cache = DynamicCache()
        for layer in range(5):
            keep = pos[layer, :k]
            cache.update(prefix.layers[layer].keys[:, :, keep], prefix.layers[layer].values[:, :, keep], layer)
        tokens, nxt, p = [], torch.tensor([suffix]), m
        for _ in range(12):
            n = nxt.shape[1]
            logits = hf(nxt, position_ids=torch.arange(p, p + n)[None], past_key_values=cache, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
            p += n
            nxt = torch.tensor([[tokens[-1]]])
    assert ours == tokens
    llm.engine.close()


@pytest.mark.parametrize("step_tokens", [None, 6])  # 6: the suffix is prefilled over 3 steps
def test_layers_load_different_counts_and_generate_what_attention_over_them_does(
    stories_path: str, tmp_path: Path, step_tokens: int | None
) -> None:
    """One layer of a stored prefix is marked "load all" (its heads disagreed): that layer loads
    every token and the others their important half and the recent window. Each layer's suffix is written right
    after its own tokens and attends to exactly them, prompt-phase H2O then brings every layer to
    k, and decoding goes on. Oracle: transformers run token by token over caches holding, per
    (layer, head), the tokens our state holds at that step, with K/V it computed itself."""
    from transformers import DynamicCache, LlamaForCausalLM

    llm = make(stories_path, tmp_path, top_k_fraction=0.5, check_agreement=False)
    ids = llm.engine.encode_prompt(STORY)
    llm.generate([ids], greedy(1, kv_policy="h2o", kv_budget=0.5))  # computes and stores, with scores
    store = llm.engine.prefix_store.store
    m = len(ids) - len(ids) % BLOCK
    suffix = llm.engine.encode_prompt(" Then she went home and had a nap.")[1:]
    prompt, q = ids[:m] + suffix, len(suffix)
    if step_tokens is not None:
        llm.engine.scheduler.config.max_num_batched_tokens = step_tokens
    nd = store.tree.match(prompt)[0].node.payload
    nd.load_all = nd.load_all.clone()
    nd.load_all[2] = True  # as if layer 2's three heads had disagreed
    half = m // 2
    k = half + q // 2  # below the whole prompt: H2O evicts; above half - q: no top-up needed
    rid, seq = first_step(llm, prompt, greedy(10, kv_policy="h2o", kv_budget=float(k)),
                          whole_prompt=step_tokens is None)
    assert seq.num_cached_tokens == m
    # per layer: the important half and the recent window's part of the prefix; layer 2 all
    held, chunks = importance_load(nd, m, len(prompt) - seq.kv_budget.num_recent)
    loads = [len(h) for h in held]
    assert loads[2] == m and all(half < c < m for i, c in enumerate(loads) if i != 2)
    state = llm.engine.runner.budget.states[seq.seq_id]
    if step_tokens is not None:  # mid-prompt: each layer's suffix so far follows its own tokens
        assert state.layer_held is not None and state.layer_held.tolist() == [c + step_tokens for c in loads]
        while not seq.output_token_ids:
            llm.engine.step()
    st = store.stats
    assert chunks[2] == m // BLOCK and st.disk_hits == sum(chunks)  # repacked chunks; layer 2 all of them
    assert st.loaded_tokens == sum(loads) // 5 and st.hit_tokens == m
    # the prompt step ends with H2O's selection: every layer at k, each from its own tokens
    assert state.layer_held is None and state.num_slots == k
    for layer in range(5):
        allowed = set(held[layer]) | set(range(m, m + q))
        assert set(state.positions[layer].flatten().tolist()) <= allowed
    kept = state.positions.cpu()  # [L, H, k]
    ours_kv = gather(llm, seq.block_table, torch.arange(k))  # [L, k, 2, H, D]

    hf = LlamaForCausalLM.from_pretrained(stories_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(5)]  # layer -> pos -> (K, V) [Hkv, D]

    def run(token: int, p: int, per_layer_head: list[list[list[int]]]) -> torch.Tensor:
        """Logits of ``token`` at position ``p`` attending, per (layer, head), to the given
        earlier positions plus itself; records its K/V."""
        cache = DynamicCache()
        for layer, heads in enumerate(per_layer_head):
            ks = torch.stack([torch.stack([kv[layer][x][0][h] for x in hp]) for h, hp in enumerate(heads)])
            vs = torch.stack([torch.stack([kv[layer][x][1][h] for x in hp]) for h, hp in enumerate(heads)])
            cache.update(ks[None], vs[None], layer)
        out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[p]]), past_key_values=cache, use_cache=True)
        for layer in range(5):
            lay = out.past_key_values.layers[layer]
            kv[layer][p] = (lay.keys[0, :, -1], lay.values[0, :, -1])
        return out.logits[0, -1]

    with torch.no_grad():
        full = hf(torch.tensor([ids[:m]]), use_cache=True).past_key_values
        for layer in range(5):
            for x in range(m):
                kv[layer][x] = (full.layers[layer].keys[0, :, x], full.layers[layer].values[0, :, x])
        for i, token in enumerate(suffix):
            logits = run(token, m + i, [[hp + list(range(m, m + i))] * 4 for hp in held])
        for layer in range(5):  # every kept (layer, head, slot) holds the oracle's K/V
            for h in range(4):
                xs = kept[layer, h].tolist()
                want = torch.stack([torch.stack([kv[layer][x][0][h], kv[layer][x][1][h]]) for x in xs])
                torch.testing.assert_close(ours_kv[layer, :, :, h], want, atol=1e-5, rtol=1e-5)
        tokens = [int(logits.argmax())]
        assert seq.output_token_ids == tokens
        while len(seq.output_token_ids) < 10:
            llm.engine.step()
            assert state.layer_held is None and state.num_slots == k  # every layer evened out at k
            p = m + q + len(tokens) - 1  # the position just fed
            now = state.positions  # [L, H, k]: what that step attended to, itself included
            per = [[[x for x in now[layer, h].tolist() if x != p] for h in range(4)] for layer in range(5)]
            tokens.append(int(run(tokens[-1], p, per).argmax()))
            assert seq.output_token_ids == tokens
    llm.engine.run_until_done()
    llm.engine.close()


@pytest.mark.parametrize("low", ["same", "float16"])
def test_load_all_under_h2o_selects_what_h2o_over_the_whole_prompt_does(
    stories_path: str, tmp_path: Path, low: str
) -> None:
    """``load_important_only=False``: a request under H2O loads every token of a stored prefix
    with the scores stored with it, so the question is computed over the whole prefix and H2O's
    prompt-phase selection is its own. Oracle: the same request recomputed over the whole prompt
    without a store -- the same kept (layer, head) positions and the same tokens. With
    ``disk_unimportant_dtype="float16"`` the chunks without an important token come back
    rounded: the selection and tokens still match here, from half the bytes for those chunks.
    Loading without the stored scores (zeros) fails it."""
    llm = make(stories_path, tmp_path, top_k_fraction=0.5, check_agreement=False,
               load_important_only=False, disk_unimportant_dtype=low)
    ids = llm.engine.encode_prompt(STORY)
    m = len(ids) - len(ids) % BLOCK
    h2o = dict(kv_policy="h2o", kv_budget=0.5)
    llm.generate([ids[:m]], greedy(1, **h2o))  # the prefix alone: its stored scores are its own
    store = llm.engine.prefix_store.store
    assert store.match_length(ids[:m] + [1], need_scores=True) == m
    prompt = ids[:m] + llm.engine.encode_prompt(" Then she went home and had a nap.")[1:]
    rid, seq = first_step(llm, prompt, greedy(12, **h2o))
    assert seq.num_cached_tokens == m and store.stats.loaded_tokens == m  # every token
    full_bytes = 5 * (m // BLOCK) * BLOCK * 4 * 8 * 2 * 4  # layers x tokens x kv-heads x head_dim x K/V x fp32
    assert store.stats.disk_bytes_read == (full_bytes if low == "same" else full_bytes * 3 // 4)
    kept = llm.engine.runner.budget.states[seq.seq_id].positions.cpu().clone()
    assert kept.shape[-1] < len(prompt)  # H2O evicted
    ref = make(stories_path)
    rid_ref, seq_ref = first_step(ref, prompt, greedy(12, **h2o))
    want = ref.engine.runner.budget.states[seq_ref.seq_id].positions.cpu()
    assert torch.equal(kept.sort(-1).values, want.sort(-1).values)
    assert finish(llm, rid) == finish(ref, rid_ref)
    llm.engine.close()


def test_short_shared_prefix_loads_whole_so_the_new_prompt_is_stored(stories_path: str, tmp_path: Path) -> None:
    """Two documents behind the same short preamble, under H2O: the second loads the preamble
    in every layer (it is shorter than what follows), so its own prompt is computed exactly and
    stored, with scores, for its next question to load."""
    llm = make(stories_path, tmp_path, top_k_fraction=0.5, check_agreement=False)
    enc = llm.engine.encode_prompt
    preamble = enc(STORY)[: 2 * BLOCK]
    doc_a, doc_b = preamble + enc(OTHERS[0])[1:], preamble + enc(OTHERS[1])[1:]
    h2o = greedy(1, kv_policy="h2o", kv_budget=0.5)
    llm.generate([doc_a], h2o)
    store = llm.engine.prefix_store.store
    llm.generate([doc_b], h2o)
    assert store.stats.hits == 1 and store.stats.hit_tokens == 2 * BLOCK
    assert store.stats.loaded_tokens == 2 * BLOCK  # every layer: the whole preamble
    aligned = len(doc_b) - len(doc_b) % BLOCK
    assert store.match_length(doc_b, need_scores=True) == aligned  # doc B itself is stored
    question = enc(" What did they do?")[1:]
    llm.generate([doc_b + question], h2o)
    assert store.stats.hits == 2 and store.stats.hit_tokens == 2 * BLOCK + aligned
    assert store.stats.loaded_tokens < 2 * BLOCK + aligned  # a long prefix: important tokens only
    llm.engine.close()


def test_storing_waits_for_the_step_after_the_first_token(stories_path: str, tmp_path: Path) -> None:
    """A budgeted prompt is copied out of its blocks before compaction, in the step that emits
    its first token, and stored (importance, tiers, disk) only before the next step; a later
    request loads it. (The oracle tests above check what such deferred copies load back.)"""
    llm = make(stories_path, tmp_path)
    engine, ps = llm.engine, llm.engine.prefix_store
    ids = engine.encode_prompt(STORY)
    rid = engine.add_request(ids, greedy(3, kv_policy="h2o", kv_budget=0.5))
    aligned = len(ids) - len(ids) % BLOCK
    assert aligned < len(ids)  # the prompt crosses a chunk boundary: scores stored as of there
    outs = engine.step()  # the whole prompt and the first token: the boundary costs no step
    assert outs[0].token_ids and ps.store.stats.stored_tokens == 0
    assert ps.pending_tokens == aligned
    engine.step()
    assert ps.pending_tokens == 0 and ps.store.stats.stored_tokens == aligned
    assert ps.store.match_length(ids, need_scores=True) == aligned
    finish(llm, rid)
    assert ps.store.stats.importance_layers == 5  # stored with its scores
    question = engine.encode_prompt(" Where did the ball go?")[1:]
    llm.generate([ids + question], greedy(3, kv_policy="h2o", kv_budget=0.5))
    assert ps.store.stats.hits == 1 and ps.store.stats.hit_tokens == aligned
    llm.engine.close()


def test_full_policy_requests_never_load_kv_the_disk_keeps_rounded(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    """With ``disk_unimportant_dtype`` a budgeted request's unimportant chunks are float16 on
    disk. A full-policy request's KV must be what recomputing gives: it stops its match before
    such a node and computes it (it loaded the rounded KV: found by a hostile-input sweep);
    a budgeted request still loads it."""
    llm = make(stories_path, tmp_path, disk_unimportant_dtype="float16", top_k_fraction=0.1,
               check_agreement=False, device_tokens=0, host_tokens=0)
    ids = llm.engine.encode_prompt(STORY)
    llm.generate([ids], greedy(1, kv_policy="h2o", kv_budget=0.5))  # stored with its importance
    llm.engine.prefix_store.store.disk.drain()
    question = llm.engine.encode_prompt(" Where did the ball go? It went")[1:]
    [out] = llm.generate([ids + question], greedy(16))
    [want] = ref.generate([ids + question], greedy(16))
    assert out.token_ids == want.token_ids and out.stats.prefix_cache_hit_tokens == 0
    [budgeted] = llm.generate([ids + question], greedy(4, kv_policy="h2o", kv_budget=0.5))
    assert budgeted.stats.prefix_cache_hit_tokens > 0
    llm.engine.close()


def test_a_store_directory_removed_while_serving_is_made_again(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    """Its files are gone (counted misses, recomputed); what is stored next is written to the
    directory made again, and hits. (Every later write failed: found by a hostile-input sweep.)"""
    import shutil

    llm = make(stories_path, tmp_path, device_tokens=0, host_tokens=0)  # every chunk on the disk
    disk = llm.engine.prefix_store.store.disk
    llm.generate(STORY, greedy())
    disk.drain()
    shutil.rmtree(disk.root)
    other = STORY.replace("Lily", "Mia")
    [want] = ref.generate(other, greedy())
    llm.generate(other, greedy())  # computed, stored again
    disk.drain()
    assert list(Path(disk.root).glob("*.kv"))
    [out] = llm.generate(other, greedy())
    assert out.token_ids == want.token_ids and out.stats.prefix_cache_hit_tokens > 0
    llm.engine.close()


def test_a_host_tier_too_large_to_allocate_names_its_option(stories_path: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"prefix_store_host_tokens"):
        make(stories_path, tmp_path, host_tokens=10**9)


def test_corrupt_chunk_file_is_recomputed_and_counted(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    llm = make(stories_path, tmp_path)
    llm.generate(STORY, greedy())
    llm.engine.prefix_store.store.disk.drain()  # the files are written (in the background)
    files = list(Path(llm.engine.prefix_store.store.disk.root).glob("*.kv"))
    assert files
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x55
        f.write_bytes(bytes(raw))
    [out] = llm.generate(STORY, greedy())
    [want] = ref.generate(STORY, greedy())
    st = llm.engine.prefix_store_stats()
    assert out.token_ids == want.token_ids
    assert st["corrupt_chunks"] >= 1 and out.stats.prefix_cache_hit_tokens == 0
    llm.engine.close()


def test_preempted_sequences_feed_the_store_and_finish_correctly(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    """A pool too small for both requests preempts one; its computed prefix is stored when it
    is preempted and loaded back when it is readmitted (instead of being recomputed)."""
    llm = LLM(stories_path, num_blocks=32, block_size=BLOCK, enable_prefix_caching=False, max_num_seqs=2,
              prefix_store=True, prefix_store_disk_path=str(tmp_path))
    ps = llm.engine.prefix_store
    freed_unfinished = []
    on_free = ps.on_free

    def spy(seq):
        before = ps.pending_tokens  # copied out at once, stored before the next step
        on_free(seq)
        if not seq.is_finished:
            freed_unfinished.append(ps.pending_tokens - before)

    llm.engine.block_manager.on_free = spy
    prompts = [STORY, OTHERS[0]]
    outs = llm.generate(prompts, greedy(100))
    wants = ref.generate(prompts, greedy(100))
    assert llm.engine.scheduler.num_preemptions > 0
    assert freed_unfinished and max(freed_unfinished) > 0
    assert ps.store.stats.hits > 0
    assert [o.token_ids for o in outs] == [w.token_ids for w in wants]
    llm.engine.close()


def test_prometheus_exposes_store_counters() -> None:
    from keyserve.cluster.metrics import ServerMetrics
    from keyserve.engine.async_engine import EngineStats

    stats = EngineStats(prefix_store={"disk_bytes_read": 7, "device_hits": 3, "importance_fallbacks": 2})
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'keyserve:prefix_store_bytes_read_total{model_name="m",tier="disk"} 7.0' in text
    assert 'keyserve:prefix_store_hits_total{model_name="m",tier="device"} 3.0' in text
    assert 'keyserve:prefix_store_importance_fallbacks_total{model_name="m"} 2.0' in text
    assert "prefix_store" not in ServerMetrics(lambda: EngineStats(), "m").render().decode()


def test_config_flat_names_serve_flags_and_refusals() -> None:
    from keyserve.config import EngineConfig, ServeConfig

    cfg = EngineConfig.from_flat(prefix_store=True, prefix_store_host_tokens=64, prefix_store_eviction="lru")
    assert cfg.prefix_store.enabled and cfg.prefix_store.host_tokens == 64 and cfg.prefix_store.eviction == "lru"
    served = ServeConfig(prefix_store=True, prefix_store_device_tokens=32).engine_config()
    assert served.prefix_store.enabled and served.prefix_store.device_tokens == 32
    assert not ServeConfig().engine_config().prefix_store.enabled
    with pytest.raises(ValueError, match="draft"):
        EngineConfig.from_flat(prefix_store=True, draft="/x")
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig.from_flat(prefix_store=True, prefix_store_chunk_size=12, block_size=8)
    with pytest.raises(ValueError, match="Ray"):
        EngineConfig.from_flat(prefix_store=True, tensor_parallel_size=2)


def test_layer_pooling_is_refused_with_a_store(stories_path: str, tmp_path: Path) -> None:
    """A stored prefix is loaded with its important tokens per kv-head, so one selection per
    layer (``kv_score_pooling="layer"``) cannot sum the heads' scores slot by slot: refused at
    admission with the field named, while the store's own engine still serves other requests
    and the score window option. Mutations caught: the ``has_prefix_store`` check dropped from
    admission (the request is accepted); the request's own policy read without the server's
    default (the last request, which names none, is refused)."""
    from keyserve.engine.errors import InvalidParamError

    llm = make(stories_path, tmp_path)
    with pytest.raises(InvalidParamError, match="kv_score_pooling") as err:
        llm.generate("Once upon a time", greedy(8, kv_policy="h2o", kv_budget=0.5, kv_score_pooling="layer"))
    assert err.value.param == "kv_score_pooling"
    [ok] = llm.generate("Once upon a time", greedy(8, kv_policy="h2o", kv_budget=0.5, kv_score_window="last"))
    assert len(ok.token_ids) == 8
    # a policy that evicts nothing (full) with a budget: the option is harmless (a budget with no
    # policy named, under the server's default full, is refused: see admission._budget)
    [ok] = llm.generate("Once upon a time", greedy(8, kv_policy="full", kv_budget=0.5, kv_score_pooling="layer"))
    assert len(ok.token_ids) == 8


def test_layer_pooling_follows_the_servers_default_budget(stories_path: str, tmp_path: Path) -> None:
    """A request that names no policy runs under the server's default: refused when that
    default selects by score, accepted when the request itself asks for no eviction. Mutation
    caught: the server's default budget ignored (the first request is accepted)."""
    from keyserve.engine.errors import InvalidParamError

    llm = LLM(stories_path, num_blocks=160, block_size=BLOCK, enable_prefix_caching=False, prefix_store=True,
              prefix_store_disk_path=str(tmp_path), default_kv_policy="h2o", default_kv_budget=0.5)
    with pytest.raises(InvalidParamError, match="kv_score_pooling"):
        llm.generate("Once upon a time", greedy(8, kv_score_pooling="layer"))
    [ok] = llm.generate("Once upon a time", greedy(8, kv_policy="full", kv_score_pooling="layer"))
    assert len(ok.token_ids) == 8


@pytest.mark.parametrize("policy, budget", [("h2o", 5), ("keyformer", 0.3)])
def test_repeated_budgeted_request_loads_scores_of_its_stored_prefix_only(
    stories_path: str, tmp_path: Path, policy: str, budget: float
) -> None:
    """A prompt that does not end on a chunk boundary is stored up to its last whole chunk; the
    scores stored with that prefix must hold the attention of the queries before the boundary
    only. The same request again loads the prefix and computes the tail itself: with the tail's
    attention stored too it was counted twice, and the selection (and the tokens) differed from
    the request without a store."""
    llm = make(stories_path, tmp_path, load_important_only=False)
    ids = llm.engine.encode_prompt(STORY)
    assert len(ids) % BLOCK  # a tail past the last whole chunk
    params = greedy(12, kv_policy=policy, kv_budget=budget, seed=3)
    [first] = llm.generate([ids], params)
    rid, seq = first_step(llm, ids, params)
    assert seq.num_cached_tokens == len(ids) - len(ids) % BLOCK  # a store hit
    kept = llm.engine.runner.budget.states[seq.seq_id].positions.cpu().clone()
    ref = make(stories_path)
    rid_ref, seq_ref = first_step(ref, ids, params)
    want = ref.engine.runner.budget.states[seq_ref.seq_id].positions.cpu()
    assert torch.equal(kept.sort(-1).values, want.sort(-1).values)
    assert finish(llm, rid) == finish(ref, rid_ref) == first.token_ids
    llm.engine.close()


@pytest.mark.parametrize("policy", ["h2o", "keyformer"])
def test_a_prompt_crossing_its_score_boundary_runs_in_one_step_with_the_boundary_scores_apart(
    stories_path: str, tmp_path: Path, policy: str
) -> None:
    """A budgeted prompt past its last chunk boundary runs in one step (the boundary used to
    cost a forward of its own before the first token): its two sides attend as two rows, whose
    sum is the scores the same prompt gets without a store, and whose first side -- what is
    stored with the prefix -- is the scores of the prompt cut at the boundary (causal: the
    queries before it see nothing after it). Keyformer's noise must be drawn at each side's own
    positions for both to hold. (A budget above the prompt: no eviction, every score compared.)"""
    llm = make(stories_path, tmp_path)
    ps = llm.engine.prefix_store
    ids = llm.engine.encode_prompt(STORY)
    aligned = len(ids) - len(ids) % BLOCK
    assert 0 < aligned < len(ids)
    params = greedy(4, kv_policy=policy, kv_budget=1000, seed=3)
    rid, seq = first_step(llm, ids, params, whole_prompt=False)
    assert seq.num_computed_tokens == len(ids)  # the whole prompt in its first step
    [pending] = ps._pending  # copied out for the store: scores as of the boundary
    split = llm.engine.runner.budget.states[seq.seq_id].scores.cpu()
    want = []
    for prompt in (ids, ids[:aligned]):  # each alone in an engine without a store
        ref = make(stories_path)
        _, alone = first_step(ref, prompt, params, whole_prompt=False)
        want.append(ref.engine.runner.budget.states[alone.seq_id].scores.cpu())
    torch.testing.assert_close(split, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pending.scores, want[1], rtol=1e-5, atol=1e-5)
    assert pending.scores.shape[-1] == aligned
    llm.engine.close()


@pytest.mark.timeout(300)
def test_node_files_replaced_by_a_directory_or_a_fifo_are_counted_misses(
    stories_path: str, ref: LLM, tmp_path: Path
) -> None:
    """Whatever stands in a node file's place is damage, not a failure of the step: a directory
    (its ``pread`` raised EISDIR out of the step) or a FIFO (its ``open`` blocked the engine
    for good) is a counted miss, recomputed, and its node is dropped. (Found by a hostile-
    environment sweep.)"""
    import os

    llm = make(stories_path, tmp_path, device_tokens=0, host_tokens=0)  # every chunk on the disk
    disk = llm.engine.prefix_store.store.disk
    texts = [STORY, OTHERS[0]]
    for text in texts:
        llm.generate(text, greedy())
    disk.drain()
    files = sorted(Path(disk.root).glob("*.kv"))
    assert len(files) == 2
    for f, replace in zip(files, (Path.mkdir, os.mkfifo)):
        f.unlink()
        replace(f)
    outs = llm.generate(texts, greedy())
    wants = ref.generate(texts, greedy())
    assert [o.token_ids for o in outs] == [w.token_ids for w in wants]
    assert all(o.stats.prefix_cache_hit_tokens == 0 for o in outs)
    assert llm.engine.prefix_store_stats()["corrupt_chunks"] == 2
    llm.engine.close()


def test_a_store_directory_replaced_by_a_file_fails_no_step(stories_path: str, ref: LLM, tmp_path: Path) -> None:
    """The private directory replaced by a plain file: reads, writes and the removal of the
    damaged nodes all fail (removing raised ENOTDIR out of the step, as a read-only directory's
    EACCES / EROFS would); every request is computed, correctly. (Found by a hostile-environment
    sweep.)"""
    import shutil

    llm = make(stories_path, tmp_path, device_tokens=0, host_tokens=0)
    disk = llm.engine.prefix_store.store.disk
    llm.generate(STORY, greedy())
    disk.drain()
    shutil.rmtree(disk.root)
    Path(disk.root).write_bytes(b"")
    [want] = ref.generate(STORY, greedy())
    for _ in range(2):
        [out] = llm.generate(STORY, greedy())
        assert out.token_ids == want.token_ids and out.stats.prefix_cache_hit_tokens == 0
    assert llm.engine.prefix_store_stats()["corrupt_chunks"] >= 1
    llm.engine.close()


def test_a_directory_left_by_a_killed_engine_is_removed_by_the_next(stories_path: str, tmp_path: Path) -> None:
    """A process killed while it serves (``kill -9``, the OOM killer) never removes its private
    directory: each crash left up to ``disk_max_gb`` behind for good. A store opening on the
    same ``disk_path`` removes the directories no live process holds, and never one a live
    engine (another replica) uses. (Found by a hostile-environment sweep.)"""
    import signal
    import subprocess
    import sys

    child = (
        "import sys, time, torch\n"
        "from keyserve.core.prefix_store import DiskTier\n"
        "d = DiskTier(sys.argv[1], 1 << 30, (2, 8, 4, 8), torch.float32, background_writes=False)\n"
        "d.write_node(1, torch.randn(5, 2, 2, 8, 4, 8))\n"
        "print(d.root, flush=True)\n"
        "time.sleep(600)\n"
    )
    live = make(stories_path, tmp_path)  # another replica on the same directory, alive
    live_root = Path(live.engine.prefix_store.store.disk.root)
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        dead_root = Path(proc.stdout.readline().strip())
        assert (dead_root / "1.kv").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert dead_root.exists()  # nobody cleaned up
    llm = make(stories_path, tmp_path)
    assert not dead_root.exists()
    assert live_root.exists() and Path(llm.engine.prefix_store.store.disk.root).exists()
    [out] = live.generate(STORY, greedy())
    live.engine.prefix_store.store.disk.drain()
    assert list(live_root.glob("*.kv"))  # the live engine's store works on
    llm.engine.close()
    live.engine.close()
    assert list(tmp_path.iterdir()) == []  # clean closes leave nothing, locks included
