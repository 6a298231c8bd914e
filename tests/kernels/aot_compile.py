"""Compile the Triton kernels to GPU machine code on a machine without a GPU (test helper).

Run in a fresh process without TRITON_INTERPRET: the launchers are called on CPU tensors with
``JITFunction.__getitem__`` replaced by a recorder, and every recorded (kernel, argument
types, constexprs) is compiled by ``triton.compile`` for ``sm_<arch>`` through ptxas (shipped
in the triton wheel). This catches what the interpreter forgives: type clashes, constructs the
compiler rejects, tl.dot shape rules. Prints one line per kernel and exits non-zero on failure.

    python tests/kernels/aot_compile.py [arch]
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_cases import make_case  # noqa: E402

from keyserve.kernels import checks  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int32: "i32", torch.int64: "i64"}


def record_launches() -> list[tuple[JITFunction, tuple, dict]]:
    calls: list[tuple[JITFunction, tuple, dict]] = []

    class Recorder:
        def __init__(self, fn: JITFunction) -> None:
            self.fn = fn

        def __call__(self, *args: object, **constexprs: object) -> None:
            calls.append((self.fn, args, constexprs))

    JITFunction.__getitem__ = lambda self, grid: Recorder(self)  # type: ignore[method-assign]
    checks.check_device = lambda name, t: None  # CPU tensors stand in for CUDA ones
    pa = importlib.import_module("keyserve.kernels.paged_attention")
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float32, 8)):
        full = dtype == torch.bfloat16  # head_dim 8 (no tl.dot): the plain paths only
        case = make_case([3, 40], 16, 2, head_dim, dtype)
        tables, lens = case.block_tables, case.context_lens
        q = torch.randn(2, 8, head_dim).to(dtype)
        pa.paged_decode_attention(q, case.k_cache, case.v_cache, tables, lens, 0.1)
        qp = torch.randn(10, 8, head_dim).to(dtype)
        starts = torch.tensor([0, 3, 10], dtype=torch.int32)
        pa.paged_prefill_attention(qp, case.k_cache, case.v_cache, tables, starts, lens, 0.1)
        if not full:
            continue
        pa.paged_decode_attention(q, case.k_cache, case.v_cache, tables, lens, 0.1,
                                  sliding_window=8, score_mode="gumbel", tau=torch.ones(2),
                                  split_k=True, partition_size=16)
        pa.paged_prefill_attention(qp, case.k_cache, case.v_cache, tables, starts, lens, 0.1,
                                   sliding_window=4, score_mode="softmax")
        pa.paged_prefill_attention(qp, case.k_cache, case.v_cache, tables, starts, lens, 0.1,
                                   score_mode="gumbel", tau=torch.ones(2))  # Keyformer's noise hash
        pa.write_kv(qp[:3, :2], qp[:3, 2:4], case.k_cache, case.v_cache,
                    torch.tensor([[1, 2], [3, -1], [5, 6]]))
    return calls


def signature(fn: JITFunction, args: tuple, constexprs: dict) -> dict[str, str]:
    sig = {}
    for name, a in zip(fn.arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TYPES[a.dtype]
        elif isinstance(a, int):
            sig[name] = "i64" if abs(a) >= 2**31 else "i32"
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} = {a!r}")
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", arch, 32)
    failures = 0
    for fn, args, constexprs in record_launches():
        try:
            src = triton.compiler.ASTSource(fn, signature(fn, args, constexprs), constexprs)
            kernel = triton.compile(src, target=target, options={"num_warps": 4})
            assert len(kernel.asm.get("cubin", b"")) > 0, "no cubin produced"
            print(f"ok   sm_{arch} {fn.__name__}", flush=True)
        except Exception as e:  # report every kernel, then fail
            failures += 1
            print(f"FAIL sm_{arch} {fn.__name__} {constexprs}: {e!r}"[:4000], flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
