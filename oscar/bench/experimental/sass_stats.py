"""Compile the decode and demotion kernels for Hopper on a machine without a GPU and count their SASS.

Usage (repo root, any machine with Triton; ``PYTHONPATH=/path/to/triton-3.6`` to match the H200's Triton):

    python -m oscar.bench.experimental.sass_stats [--keep DIR] [--only triton|cuda|all]

For each kernel configuration: registers and spill bytes (``ptxas -v``), shared memory, and for the
split-K kernels the instructions of the main loop (the longest backward branch in the SASS) per warp
and per token and KV head, with the most frequent opcodes. No device time: ``triton.compile`` targets
``sm_90`` and Triton's bundled ``ptxas``/``cuobjdump`` do the rest.

The CUDA decode kernels (v10 ``decode_mma.cu``, v11 ``decode_v11.cu``; ``--only cuda``) are compiled with
``nvcc -cubin -arch sm_90a -Xptxas -v`` (``$NVCC`` or ``nvcc`` on the path) from a file that instantiates their
templates; their main loop is the longest backward branch that holds tensor-core instructions, and the report
gives its warp-instructions per 16-token block (v10: one block per iteration, v11: a page of ``PS/16`` blocks).
The static count includes the branch that rescales the output when a running max moves (skipped otherwise).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
import oscar.kernels.decode_rows as da
import oscar.kernels.quantize as qz

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DIV16 = {"stride_kmp", "stride_kmh", "stride_cp", "stride_ch", "stride_mp", "stride_mh", "tokens_per_split", "stride_sb", "stride_sh", "stride_st",
         "stride_rb", "stride_rh", "stride_rt", "stride_xn", "stride_xh", "stride_xt", "stride_cs", "stride_sp",
         "stride_ss"}


def compile_sass(fn, ptr_types: dict[str, str], const: dict, out: Path, tag: str, **options) -> dict:
    """Compile ``fn`` for sm_90 with ints in ``DIV16`` and pointers marked 16-divisible (as at a real launch)."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else ptr_types.get(n, "i32")) for n in names}
    div = [n for n in names if n not in const and (sig[n].startswith("*") or n in DIV16)]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx, obj = out / f"{tag}.ptx", out / f"{tag}.o"
    ptx.write_text(k.asm["ptx"])
    ptxas = BIN / ("ptxas-blackwell" if (BIN / "ptxas-blackwell").exists() else "ptxas")
    log = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(obj)], capture_output=True,
                         text=True).stderr
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(obj)], capture_output=True, text=True).stdout
    (out / f"{tag}.sass").write_text(sass)
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return {"regs": int(regs[0]) if regs else -1, "spill": int(spill[0]) if spill else -1, "smem": k.metadata.shared,
            "sass": sass}


def loop_body(sass: str, need: tuple = (), avoid: tuple = (), shortest: bool = False) -> list[str]:
    """Instructions of the longest loop (backward branch) in a SASS listing that holds every opcode of ``need``
    and none of ``avoid``; ``shortest``: the innermost such loop instead (nvcc places warp-divergence fallbacks
    after the kernel's exit, and their backward branches span the whole kernel)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best: list[str] = []
    for addr, text in ins:
        if "BRA" in text:
            m = re.search(r"0x([0-9a-f]+)", text.split("BRA")[1])
            if m and int(m.group(1), 16) < addr:
                body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
                ops = {opcode(t) for t in body}
                if not set(need) <= ops or ops & set(avoid):
                    continue
                if not best or (len(body) < len(best) if shortest else len(body) > len(best)):
                    best = body
    return best


def opcode(text: str) -> str:
    return (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]


KERNELS = Path(da.__file__).parent
# main loops: v10's issues cp.async (LDGSTS), v11's waits on an mbarrier (SYNCS) and loads nothing from global memory
MAIN_LOOP = {"decode_mma.cu": (("HMMA", "LDGSTS"), ()), "decode_v11.cu": (("HMMA", "SYNCS"), ("LDG",))}
# (tag, source file, template instance, 16-token blocks per main-loop iteration, the instance's settings)
CUDA_CASES = [
    ("v10_mma_d128_gqa4", "decode_mma.cu", "oscar_decode_mma<128,2,4,8,4,2,0>", 1,
     "8 warps, 4 stages, 2 CTAs/SM (the served default)"),
    ("v10_mma_d128_gqa8", "decode_mma.cu", "oscar_decode_mma<128,2,8,8,4,2,0>", 1,
     "8 warps, 4 stages, 2 CTAs/SM (the served default)"),
    ("v10_mma_d128_gqa4_rope", "decode_mma.cu", "oscar_decode_mma<128,2,4,8,4,2,8>", 1,
     "rope-centered keys, a turn per 8 blocks of a warp (the served default)"),
    ("v10_mma_d128_gqa4_ch64", "decode_mma.cu", "oscar_decode_mma<128,2,4,8,4,2,0,64>", 1,
     "per-channel keys, blocks of 64 tokens (the served default)"),
    ("v11_d128_ps64_gqa4", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,3,0,0>", 4,
     "4 math warps + 1 producer, 8 records in flight, 3 CTAs/SM"),
    ("v11_d128_ps64_gqa4_minb2", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,2,0,0>", 4,
     "4 math warps + 1 producer, 8 records in flight, 2 CTAs/SM (the default below 64 sequence x KV head pairs)"),
    ("v11_d128_ps64_gqa8", "decode_v11.cu", "oscar_decode_v11<128,64,8,4,8,3,0,0>", 4,
     "4 math warps + 1 producer, 8 records in flight, 3 CTAs/SM"),
    ("v11_d64_ps64_gqa4", "decode_v11.cu", "oscar_decode_v11<64,64,4,4,8,3,0,0>", 4,
     "4 math warps + 1 producer, 8 records in flight, 3 CTAs/SM"),
    ("v11_d128_ps64_gqa4_rope", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,3,1,0>", 4,
     "rope-centered keys (the served auto format), 3 CTAs/SM"),
    ("v11_d128_ps64_gqa4_rope_minb2", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,2,1,0>", 4,
     "rope-centered keys, 2 CTAs/SM"),
    ("v11_d128_ps64_gqa4_ch64", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,3,0,64>", 4,
     "per-channel keys, blocks of 64 tokens, 3 CTAs/SM"),
    ("v11_d128_ps64_gqa4_ch16", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,3,0,16>", 4,
     "per-channel keys, blocks of 16 tokens (a channel block per tile), 3 CTAs/SM"),
    ("v11_d128_ps64_gqa4_rope_ch64", "decode_v11.cu", "oscar_decode_v11<128,64,4,4,8,3,1,64>", 4,
     "rope-centered per-channel keys, blocks of 64 tokens, 3 CTAs/SM"),
    ("v11_d128_ps64_gqa8_rope_ch64", "decode_v11.cu", "oscar_decode_v11<128,64,8,4,8,3,1,64>", 4,
     "rope-centered per-channel keys, blocks of 64 tokens, GQA 8, 3 CTAs/SM"),
]


def _mangled_functions(sass: str) -> list[str]:
    return re.findall(r"Function : (\S+)", sass)


def _source(src: str, rev: str) -> str:
    if not rev:
        return (KERNELS / src).read_text()
    return subprocess.run(["git", "show", f"{rev}:kernels/{src}"], cwd=KERNELS, capture_output=True, text=True,
                          check=True).stdout


def cuda_stats(out: Path, cases: list = CUDA_CASES, rev: str = "") -> list[dict]:
    """Compile each CUDA instance for sm_90a with nvcc; registers, spills and main-loop instructions per block.
    ``rev``: read v10's source at this git revision (default: the working tree)."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/bin/nvcc"
    rows = []
    for tag, src, inst, blocks, note in cases:
        cu = out / f"{tag}.cu"
        name, args = inst.split("<", 1)
        params = "Params" if src == "decode_mma.cu" else "Params11"
        cu.write_text(f"{_source(src, rev if src == 'decode_mma.cu' else '')}\ntemplate __global__ void {name}<{args}(const {params});\n")
        cubin = out / f"{tag}.cubin"
        res = subprocess.run([nvcc, "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                              str(cu), "-o", str(cubin)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {inst}: {res.stderr[-2000:]}")
        log = res.stderr
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        (out / f"{tag}.sass").write_text(sass)
        body = loop_body(sass, *MAIN_LOOP[src], shortest=True)
        mix = collections.Counter(opcode(t) for t in body)
        regs = re.findall(r"Used (\d+) registers", log)
        spill = re.findall(r"(\d+) bytes spill stores", log)
        rows.append({"tag": tag, "instance": inst, "settings": note, "regs": int(regs[0]) if regs else -1,
                     "spill_bytes": int(spill[0]) if spill else -1, "loop": len(body), "blocks_per_iter": blocks,
                     "per_block": len(body) / blocks, "hmma": mix.get("HMMA", 0), "lds": mix.get("LDS", 0),
                     "ldg": mix.get("LDG", 0) + mix.get("LDGSTS", 0), "mix": dict(mix.most_common(10))})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="folder for the PTX/SASS files (default: a temporary one)")
    ap.add_argument("--only", choices=("triton", "cuda", "all"), default="all", help="which kernels to compile")
    ap.add_argument("--v10-rev", default="", help="git revision of decode_mma.cu (default: the working tree)")
    args = ap.parse_args()
    out = args.keep or Path(tempfile.mkdtemp(prefix="oscar_sass_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.only in ("cuda", "all"):
        for r in cuda_stats(out, rev=args.v10_rev):
            print(f"{r['tag']} ({r['instance']}, {r['settings']}): {r['regs']} registers, {r['spill_bytes']} B "
                  f"spilled; main loop {r['loop']} instructions per warp iteration of {r['blocks_per_iter']} "
                  f"16-token block(s) = {r['per_block']:.1f} per block (HMMA {r['hmma']}, LDS {r['lds']}, "
                  f"global loads {r['ldg']}); {r['mix']}")
        if args.only == "cuda":
            return 0
    ptrs = {"q_ptr": "*bf16", "scale": "fp32", "rk_ptr": "*fp16", "muk_ptr": "*fp32", "rv_ptr": "*fp16",
            "muv_ptr": "*fp32", "qr_ptr": "*fp32", "qmu_ptr": "*fp32", "kc_ptr": "*u8", "ks_ptr": "*bf16",
            "kz_ptr": "*bf16", "vc_ptr": "*u8", "vs_ptr": "*bf16", "vz_ptr": "*bf16", "pt_ptr": "*i32",
            "len_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qo_ptr": "*fp32", "sk_ptr": "*bf16",
            "sv_ptr": "*bf16", "slen_ptr": "*i32", "recent_k_ptr": "*bf16", "recent_v_ptr": "*bf16", "rlen_ptr": "*i32",
            "wrow_ptr": "*i32"}
    bf = dict(HKV=8, REP=4, HP=16, D=128, BITS=2, PAGE_SIZE=64, FAST_UNPACK=True, FUSE_BF16=False, BF_BLOCK=32,
              CHUNK=64, HAS_SINK=True, HAS_RECENT=True, DOT_T=tl.bfloat16, WIN_ROWS=False)
    plane = dict(HAS_RK=True, HAS_MUK=True, ROT_OUT=True, HAS_MUV=True, **da.plane_sources(2))
    word_ptrs = {**ptrs, "kc_ptr": "*i32", "vc_ptr": "*i32", "rk_ptr": "*bf16", "rv_ptr": "*bf16"}
    word = dict(G=128, KBLOCK=0)  # per-token keys (per-channel key pages: KBLOCK = T)
    cases = [
        ("v8_planes_b128_r128", da._planes_kernel, ptrs, {**bf, **plane, "BLOCK_N": 128, "ROW_GATHER": True},
         dict(num_warps=4, num_stages=2, maxnreg=128), 128),
        ("v8_planes_b64", da._planes_kernel, ptrs, {**bf, **plane, "BLOCK_N": 64, "ROW_GATHER": False},
         dict(num_warps=4, num_stages=2), 64),
        ("v7_words_b128", da._partial_kernel, word_ptrs, {**bf, **word, "BLOCK_N": 128, "ROW_GATHER": True},
         dict(num_warps=4, num_stages=2), 128),
    ]
    print(f"triton {triton.__version__}, files in {out}")
    for tag, fn, p, const, opts, block in cases:
        r = compile_sass(fn, p, const, out, tag, **opts)
        body = loop_body(r["sass"])
        mix = collections.Counter(opcode(t) for t in body).most_common(8)
        per = len(body) * opts["num_warps"] / block
        print(f"{tag}: {r['regs']} registers, {r['spill']} B spilled, {r['smem']} B shared; loop {len(body)} "
              f"instructions per warp = {per:.1f} per token and KV head; {dict(mix)}")
    qptrs = {"x_ptr": "*bf16", "src_ptr": "*i64", "slot_ptr": "*i64", "r_ptr": "*fp32", "mu_ptr": "*fp32",
             "rho_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16", "x2_ptr": "*bf16",
             "r2_ptr": "*fp32", "mu2_ptr": "*fp32", "rho2_ptr": "*fp32", "codes2_ptr": "*u8", "scale2_ptr": "*bf16",
             "zero2_ptr": "*bf16", "bidx_ptr": "*i32", "bidx2_ptr": "*i32"}
    qc = dict(PAGE_SIZE=64, D=128, G=128, BITS=2, HAS_SRC=True, HAS_ROT=True, HAS_MU=True, CLIP=True,
              PRECISION="tf32x3", MMA=False)
    for tag, const, nw in (("demote_rows_w1", {**qc, "BLOCK_T": 1, "ROW_PATH": True}, 1),
                           ("quantize_blocks_w8", {**qc, "BLOCK_T": 16, "ROW_PATH": False}, 8)):
        r = compile_sass(qz._rotate_quantize_kernel, qptrs, const, out, tag, num_warps=nw)
        n = sum(1 for line in r["sass"].splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
        print(f"{tag}: {r['regs']} registers, {r['spill']} B spilled, {n} SASS instructions")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    raise SystemExit(main())
