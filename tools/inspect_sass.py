"""What ptxas makes of the Hopper attention kernel (`kernels/attention/gluon.py`), on any machine (no GPU needed):
registers, spills, programs per SM, whether ptxas serialised the wgmmas, and the main loop's SASS instruction mix.

Each tile is compiled for sm90 with the specialisation Triton's JIT gives a fused QKV buffer and a contiguous output
(the integer arguments marked divisible by 16 where they are: not O's head stride at 72). Without those hints the
same source compiles to a different kernel, so numbers read off a plain `triton.compile` are not the ones the GPU
runs.

Usage: python -m tools.inspect_sass [--head-dims 64 72] [--gluon [128/128/8/2/128 ...]] [--uniform] [--json]
       python -m tools.inspect_sass --dump-gluon-sass DIR  (every candidate's SASS, both variants, one file
       each: diff two such directories to see whether a change to the kernel's source changed what the GPU runs)
(with TRITON_INTERPRET unset: the interpreter's kernels cannot be compiled)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from kernels.attention import gluon as ga
from kernels.attention import tiles

SM90_REGS = 65536
SM90_SMEM = 227 * 1024  # per SM, usable by CTAs (each also reserves 1 KB)
def _tool(name: str) -> str:
    if name == "ptxas":  # the one Triton itself runs for sm90 (3.9 ships two)
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def gluon_fields(config: tiles.GluonTile) -> tuple[int, ...]:
    """A Gluon candidate in --gluon's field order: block_m/block_n/warps/ring/cap/remainder copied/sum_mma/persistent
    programs per SM."""
    return (config.block_m, config.block_n, config.num_warps, config.ring, config.maxnreg, int(config.rem_copy),
            int(config.sum_mma), config.persistent)


def compile_gluon_tile(tile: tuple[int, ...], head_dim: int, uniform: bool = False) -> dict:
    """The Gluon kernel (kernels/attention/gluon.py) for one of its tiles, (block_m, block_n, warps, ring depth,
    register cap or 0), specialised as the JIT does for a fused QKV buffer and a contiguous output; `uniform`: the
    variant for packs of equal lengths."""
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, warps, nbuf, maxnreg, *rest = tile
    rest += [1, 1, 0][len(rest):]
    rem_copy, ws = bool(rest[0]), rest[2]
    d0, d1, _ = tiles.head_dim_split(head_dim)
    w1 = ga.REM_WIDTH if d1 else 0
    fn = ga._gl_varlen_attn_ws if ws else ga._gl_varlen_attn_fwd
    sig = {name: "i32" for name in fn.arg_names}

    def desc(rows, cols):
        return f"tensordesc<bf16[{rows},{cols}],{ga._smem_layout(rows, cols, torch.bfloat16)!r}>"

    q_rows = bm // ga.ws_halves(warps, ws)
    # the fused QKV buffer: one descriptor per box shape (launch_gluon), K's and V's heads at column offsets
    same = q_rows == bn
    sig.update(q_desc=desc(q_rows, d0), kv_desc=None if same else desc(bn, d0), O="*bf16", CU_SEQLENS="*i32",
               qk_scale="fp32", q1_desc=desc(q_rows, w1) if w1 else None,
               kv1_desc=(desc(w1, bn) if rem_copy else None if same else desc(bn, w1)) if w1 else None)
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, NBUF=nbuf, W1=w1, REM_T=rem_copy,
                     R_ROWS=tiles.remainder_rows(head_dim), SUM_ASKED=True, UNIFORM=uniform, num_warps=warps)
    if ws:  # as launch_gluon launches it
        constants.update(ga.ws_options(warps, ws, maxnreg))
        maxnreg = constants.pop("maxnreg")
    constants.update({name: None for name in ("kv_desc", "q1_desc", "kv1_desc") if sig[name] is None})
    sig.update({name: "constexpr" for name in constants})
    # the JIT marks the integer arguments divisible by 16 where they are (at 72 O's head stride is not)
    ints = {"stride_ot": 16 * head_dim, "stride_oh": head_dim, "k_col": 16 * head_dim, "v_col": 32 * head_dim,
            "max_seqlen": 1024, "heads": 16, "n_items": 16 * 1024 // bm * 8}
    ints = {name: value for name, value in ints.items() if name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("O", "CU_SEQLENS") + tuple(n for n, value in ints.items() if value % 16 == 0)}
    options = {"num_warps": constants["num_warps"], **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(GluonASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    report = _report(kernel, warps, bm * bn, loads_in_loop=not ws)
    if ws:  # persistent programs: ws of them must fit an SM's shared memory (their registers are the cap's)
        report["programs_per_sm"] = min(ws, SM90_SMEM // (kernel.metadata.shared + 1024))
    return report


def _ptxas(kernel) -> tuple[str, str]:
    """ptxas run again here on the kernel's PTX (which carries any register cap as .maxnreg), so that its -v report
    is captured; the report and the SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True,
                             text=True, check=True).stderr
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    return log, sass


def _report(kernel, num_warps: int, tile_scores: int, loads_in_loop: bool = True) -> dict:
    """ptxas's report and the main loop's SASS mix of a kernel compiled for sm90 (and the SASS itself, `sass`)."""
    log, sass = _ptxas(kernel)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    threads = 32 * num_warps
    smem = kernel.metadata.shared
    per_sm = min(SM90_REGS // (-(-regs // 8) * 8 * threads), SM90_SMEM // (smem + 1024))
    serialised = re.search(r"wgmma[^\n]*serialized due to ([^\n]*?) in the function", log)
    loop = _main_loop(sass, ("HGMMA", "MUFU", "UTMALDG") if loads_in_loop else ("HGMMA", "MUFU"))
    scores = tile_scores / threads  # scores per thread per step
    return {
        "registers": regs, "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        "shared_bytes": smem, "programs_per_sm": per_sm,
        "wgmma_serialised": serialised.group(1) if serialised else None,
        "loop_instructions": len(loop), "per_score": round(len(loop) / scores, 2),
        "loop_ops": collections.Counter(_opcode(i) for i in loop).most_common(), "sass": sass,
    }


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def _main_loop(sass: str, needs=("HGMMA", "MUFU", "UTMALDG")) -> list[str]:
    """The steady-state step of the full tile: of the backward branches whose span holds a wgmma, an exp2 and (in
    `needs`; not where a loader partition issues them) a TMA load, the longest unmasked one (ptxas may place other
    blocks inside a loop's address span, so spans are told apart by their content)."""
    instructions, labels, pending = [], {}, None
    for line in sass.splitlines():
        line = line.strip()
        if m := re.match(r"\.(L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(m.group(1), 16)
            instructions.append((address, m.group(2)))
            if pending:
                labels[pending], pending = address, None
    spans = []
    for address, text in instructions:
        m = re.search(r"BRA.*?\.(L_x_\d+)", text)
        if m and labels.get(m.group(1), address) < address:
            body = [t for a, t in instructions if labels[m.group(1)] <= a <= address]
            if all(any(op in t for t in body) for op in needs):
                spans.append((labels[m.group(1)], address, body))
    # Masked steps (the tails) select with FSEL; of the unmasked loops, the full tile's is the longest
    return min((body for _, _, body in spans), key=lambda b: (sum("FSEL" in t for t in b), -len(b)), default=[])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72])
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--gluon", nargs="*", default=[],
                    help="tiles as block_m/block_n/warps/ring/register cap[/remainder copied[/sum_mma[/ws]]] "
                         "(default: the candidates)")
    ap.add_argument("--uniform", action="store_true", help="the Gluon kernel's variant for packs of equal lengths")
    ap.add_argument("--dump-gluon-sass", metavar="DIR", help="write every Gluon candidate's SASS under DIR")
    args = ap.parse_args()
    if args.dump_gluon_sass:
        os.makedirs(args.dump_gluon_sass, exist_ok=True)
        for head_dim, candidates in tiles.GLUON_TILES.items():
            for config in candidates:
                for uniform in (False, True):
                    tile = gluon_fields(config)
                    name = f"d{head_dim}_" + "_".join(map(str, tile)) + ("_uniform" if uniform else "")
                    with open(os.path.join(args.dump_gluon_sass, name + ".sass"), "w") as f:
                        f.write(compile_gluon_tile(tile, head_dim, uniform)["sass"])
        return
    for head_dim in args.head_dims:
        listed = [gluon_fields(c) for c in tiles.GLUON_TILES.get(head_dim, [])]
        for tile in [tuple(map(int, t.split("/"))) for t in args.gluon] or listed:
            report = compile_gluon_tile(tile, head_dim, args.uniform)
            del report["sass"]
            name = "/".join(map(str, map(int, tile)))
            print(json.dumps({"head_dim": head_dim, "tile": name, **report}) if args.json
                  else f"gluon d{head_dim} {name} {report}", flush=True)

if __name__ == "__main__":
    main()
