"""Every kernel compiles for an H100/H200 (sm_90) without a GPU: Triton's AOT path, in a subprocess.

The interpreter (which runs the other tests) never lowers a kernel to PTX, so an op that the
GPU compiler rejects would only show on the GPU machine. This compiles each kernel family with
the settings the launchers use (the backward with one and two rows per step), for bf16 and fp32, to a cubin with the ptxas bundled in the
triton wheel; the cross-entropy "fast" kernel with its inline PTX (ex2/rcp.approx.ftz) in two specialisations, and the
one-program-per-row cross-entropy kernel with and without a softcap.
"""

import textwrap

import pytest

from tests.helpers.kernel_checks import assert_compiles_in_subprocess

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mfuwatch.kernels import _glu_triton as G, _norm_launch as L, _norm_triton as K

    target = GPUTarget("cuda", 90, 32)
    n = 0

    def comp(fn, sig, consts, num_warps, **options):
        global n
        k = triton.compile(ASTSource(fn, sig, consts), target=target, options=dict(options, num_warps=num_warps))
        assert k.asm["cubin"], fn.__name__
        n += 1

    for dt, (is_rms, has_b, res, llama) in [("bf16", (True, False, False, True)), ("bf16", (False, True, False, False)),
                                            ("fp32", (True, False, True, True))]:
        p = "*" + dt
        fwd = dict(X=p, R=p, W=p, B=p, Y=p, S=p, MEAN="*fp32", RSTD="*fp32", stride_x="i64", stride_r="i32",
                   stride_y="i32", stride_s="i32", n_rows="i32", N="i32", eps="fp32", offset="fp32")
        flags = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=has_b, HAS_RES=res, LLAMA_CAST=llama)
        comp(K._norm_fwd_fused, fwd, dict(flags, ROWS=2, BLOCK_N=2048), 8)
        comp(K._norm_fwd_looped, fwd, dict(flags, BLOCK_N=4096, N_FIXED=0), 8)
        comp(K._norm_fwd_looped, fwd, dict(flags, BLOCK_N=2048, N_FIXED=8192), 8)
        bwd = dict(DY=p, XS=p, W=p, MEAN="*fp32", RSTD="*fp32", DRES=p, DX=p, DX2=p, PART="*fp32",
                   stride_dy="i32", stride_xs="i64", stride_dres="i32", stride_dx="i32", n_rows="i32", N="i32",
                   rows_per_prog="i32", db_off="i32", offset="fp32")
        bflags = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=has_b, HAS_DRES=res, LLAMA_CAST=llama, HAS_DX2=res)
        for rows in (1, 2):  # rows per step of the backward's loop
            comp(K._norm_bwd_fused, bwd, dict(bflags, ROWS=rows, BLOCK_N=4096), 16)
        comp(K._norm_bwd_fused, bwd, dict(bflags, ROWS=2, BLOCK_N=4096), 16, maxnreg=64)  # the register-capped setting
        comp(K._norm_bwd_looped, bwd, dict(bflags, BLOCK_N=4096), 8)
        for act in (G.SILU, G.GELU, G.GELU_TANH):
            comp(G._glu_fwd_elementwise, dict(G=p, U=p, Y=p, stride_g="i32", stride_u="i32", N="i64",
                                             n_col_blocks="i32"), dict(ACT=act, BLOCK=1024), 4)
            for write_y in (False, True):  # True: the fused down projection's backward also writes h
                comp(G._glu_bwd_elementwise, dict(DY=p, G=p, U=p, DG=p, DU=p, Y=p, stride_dy="i32", stride_g="i32",
                                                 stride_u="i32", N="i64", n_col_blocks="i32"),
                     dict(ACT=act, BLOCK=2048, WRITE_Y=write_y), 8)
    for dt in ("bf16", "fp32"):
        for tile in L._SUM_CONSTS.values():  # every tile the launcher uses (three)
            comp(K._sum_partials, dict(P="*fp32", OUT0="*" + dt, OUT1="*" + dt, n_parts="i32", N="i32",
                                       n_col_blocks="i32"), tile, 4)
    from mfuwatch.kernels import _rotary_triton as RT
    names = list(RT._rotary_kernel.arg_names)
    for dt, (interleaved, backward, has_pass) in [("bf16", (False, False, False)), ("bf16", (False, True, True)),
                                                  ("fp32", (True, False, False))]:
        sig = {a: ("*" + dt if i < 6 else "i32") for i, a in enumerate(names[:-8])}
        comp(RT._rotary_kernel, sig, dict(INTERLEAVED=interleaved, BACKWARD=backward, HAS_PASS=has_pass, BLOCK_T=1,
                                          BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, BLOCK_P=32 if has_pass else 1), 4)
    from mfuwatch.kernels import _cross_entropy_triton as CE
    ce_sig = dict(X="*bf16", T="*i64", LOSS="*fp32", LSE="*fp32", DX="*bf16", SCALE="*fp32", rows="i32",
                  stride_x="i32", stride_dx="i32", V="i32", ignore_index="i32", smoothing="fp32", z_loss="fp32",
                  softcap="fp32", kexp="fp32")
    for cap, local, newton in ((False, False, False), (True, True, True)):  # the inline PTX (ex2, rcp) assembles
        comp(CE._ce_fast_kernel, ce_sig, dict(HAS_SOFTCAP=cap, SMOOTH=cap, ZLOSS=cap, HINTS=local, BLOCK=4096,
                                              STAGES=3, NEWTON1=newton, NEWTON2=False, ASM=True, LOCAL=local, VEC=8,
                                              FIXED=local), 8)
    # the one-program-per-row kernel ("rev", writing the gradient; the shared loss/coef/gradient helpers)
    fwd_sig = {k: v for k, v in ce_sig.items() if k != "kexp"}
    for cap in (False, True):
        comp(CE._ce_fwd_kernel, fwd_sig, dict(HAS_SOFTCAP=cap, WRITE_GRAD=True, HINTS=False, BLOCK=2048, STAGES=4,
                                              REVERSE=True, LANES=False), 4)
    print("compiled", n)
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    assert_compiles_in_subprocess(SCRIPT, 61)  # 52 + the glu backward with WRITE_Y, 3 activations x 3 dtypes
