"""Every kernel (the engine's paged attention and the Mamba2 kernels too) compiles for a Hopper GPU (sm_90) on
this GPU-less machine, at the tile sizes the launchers pick.

The interpreter runs the kernels' Python, not Triton's compiler, so type errors in compiled code and tiles that
overflow shared memory would otherwise first show on a lent GPU. triton.compile needs no GPU to produce a cubin
(it bundles ptxas). It runs in a subprocess because this test session has TRITON_INTERPRET=1 set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent('''
    import json, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gpuformers.kernels import attention, fused_linear_cross_entropy as fce, rms_norm, rotary, swiglu

    def build(fn, pointers, constexprs, warps, stages, floats=("eps", "qk_scale", "sm_scale")):
        signature = {}
        for name in fn.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = pointers[name]
            else:
                signature[name] = "fp32" if name in floats else "i32"
        src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        return kernel.metadata.shared

    shared = {}
    P, F32 = "*bf16", "*fp32"
    shared["rms_norm fwd"] = build(rms_norm._rms_norm_fwd_kernel, dict(X=P, RES=P, W=P, Y=P, RES_OUT=P, RSTD=F32),
                                   dict(HAS_RESIDUAL=True, BLOCK=4096), 16, 1)
    shared["rms_norm bwd"] = build(rms_norm._rms_norm_bwd_kernel, dict(DY=P, X=P, W=P, RSTD=F32, DRES_OUT=P, DX=P,
                                   DW_PARTIAL=F32), dict(HAS_DRES=True, BLOCK=4096), 16, 1)
    shared["swiglu bwd"] = build(swiglu._silu_mul_bwd_kernel, dict(DY=P, G=P, U=P, DG=P, DU=P),
                                 dict(GATED=True, BLOCK=1024), 4, 1)
    shared["rotary"] = build(rotary._rotary_kernel, dict(X=P, Y=P, COS=P, SIN=P),
                             dict(BACKWARD=True, BLOCK_H=16, BLOCK_D=64), 1, 1)
    shared["cross_entropy"] = build(fce._cross_entropy_kernel, dict(LOGITS=P, LABELS="*i64", LOSS=F32, GRAD=P, SCALE=F32),
                                    dict(WRITE_GRAD=True, BLOCK_V=4096), 8, 1)
    for dtype, ptr in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        pointers = {n: ptr for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
        pointers.update(LSE=F32, DELTA=F32, MASK="*u8", CU_Q="*i32", CU_K="*i32")
        flags = dict(GROUP=4, CAUSAL=True, HAS_WINDOW=True, HAS_MASK=False, VARLEN=True,
                     PRECISION=attention.dot_precision(dtype), BLOCK_D=128)
        kinds = (("fwd", attention._attn_fwd_kernel), ("dkdv", attention._attn_bwd_dkdv_kernel),
                 ("dq", attention._attn_bwd_dq_kernel))
        for kind, fn in kinds if dtype == torch.bfloat16 else kinds[:1]:  # float32: the forward's larger tiles
            block_m, block_n, warps, stages = attention.tile_sizes(torch.device("cuda"), 128, kind, dtype)
            shared[f"attention {kind} {dtype}"] = build(fn, pointers, dict(flags, BLOCK_M=block_m, BLOCK_N=block_n),
                                                        warps, stages)
    from gpuformers.engine import paged_attention_triton as paged
    pointers = dict(BLOCK_TABLES="*i64", CONTEXT_LENS="*i64", CU_Q="*i32")
    pointers.update({n: "*bf16" for n in ("Q", "K", "V", "OUT")})
    shared["paged decode"] = build(paged._paged_decode_kernel, pointers, dict(
        N_REP=2, ROWS=16, HEAD_DIM=128, D_P2=128, BLOCK_SIZE=256, BLOCK_N=64, HAS_WINDOW=True,
        PRECISION="tf32"), 4, 3, floats=("scale",))  # the launcher leaves Triton's defaults
    for dtype, ptr in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        pointers.update({n: ptr for n in ("Q", "K", "V", "OUT")})
        block_m, block_n, warps, stages = attention.tile_sizes(torch.device("cuda"), 128, "fwd", dtype)
        shared[f"paged prefill {dtype}"] = build(paged._paged_prefill_kernel, pointers, dict(
            GROUP=2, HEAD_DIM=128, D_P2=128, BLOCK_SIZE=256, BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=True,
            PRECISION=attention.dot_precision(dtype)), warps, stages, floats=("qk_scale",))
    from gpuformers.kernels import causal_conv1d, ssd
    shared["ssd dt"] = build(ssd._chunk_dt_kernel, dict(DT=P, DT_BIAS=P, A=F32, DT_OUT=F32, ACUM=F32),
                             dict(BLOCK_L=256), 4, 3, floats=("dt_min", "dt_max"))
    shared["ssd state pass"] = build(ssd._state_pass_kernel, dict(STATES=F32, INIT=F32, FINAL=F32, ACUM=F32),
                                     dict(HAS_INIT=True, BLOCK_P=64, BLOCK_N=128), 4, 3)
    for dtype, ptr, state in ((torch.bfloat16, "*bf16", 128), (torch.float32, "*fp32", 256)):  # the largest tiles
        block_m, block_s, block_p, block_n, warps, stages = ssd.scan_tiles(64, state, 256)
        tiles = dict(BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_N=block_n, PRECISION=attention.dot_precision(dtype))
        shared[f"ssd chunk state {dtype}"] = build(ssd._chunk_state_kernel, dict(
            X=ptr, B=ptr, DT=F32, ACUM=F32, STATES=F32), dict(tiles, FROM_START=False), warps, stages)
        shared[f"ssd chunk scan {dtype}"] = build(ssd._chunk_scan_kernel, dict(
            X=ptr, B=ptr, C=ptr, D=ptr, DT=F32, ACUM=F32, STARTS=F32, Y=F32), dict(tiles, BLOCK_M=block_m), warps,
            stages)
    from gpuformers.kernels import ssd_backward as ssd_bwd  # the backward, at the launcher's tiles
    shared["ssd dstate pass"] = build(ssd_bwd._dstate_pass_kernel, dict(
        DSTATES=F32, STATES=F32, FINAL=F32, DFINAL=F32, DINIT=F32, ACUM=F32, END_DOT=F32),
        dict(BLOCK_P=64, BLOCK_N=128), 4, 3)
    shared["ssd dt backward"] = build(ssd_bwd._dt_backward_kernel, dict(
        DT_RAW=P, DT_BIAS=P, A=F32, DT=F32, DDT_DIRECT=F32, DA_POS=F32, DA_NEG=F32, END_DOT=F32, DDT_RAW=P,
        DA_PART=F32, DBIAS_PART=F32), dict(BLOCK_L=256), 4, 3, floats=("dt_min", "dt_max"))
    for dtype, ptr, state in ((torch.bfloat16, "*bf16", 128), (torch.float32, "*fp32", 256)):
        _, block_s, block_p, block_n, warps, stages = ssd.scan_tiles(64, state, 256)
        precision = attention.dot_precision(dtype)
        shared[f"ssd chunk state backward {dtype}"] = build(ssd._chunk_state_kernel, dict(
            X=F32, B=ptr, DT=F32, ACUM=F32, STATES=F32), dict(BLOCK_S=block_s, BLOCK_P=block_p, BLOCK_N=block_n,
            PRECISION=precision, FROM_START=True), warps, stages)
        # as ssd_chunk_scan_backward picks them: head_dim 64 and 128; dx and dB apart when (head_dim, state) is large
        for head_dim in (64, 128):
            rows = 32 if head_dim * block_n <= 64 * 64 else 16
            tiles = dict(BLOCK_S=rows, BLOCK_L=rows, BLOCK_P=head_dim, BLOCK_N=block_n, PRECISION=precision)
            for parts in ([(True, True)] if head_dim * block_n <= 64 * 256 else [(True, False), (False, True)]):
                shared[f"ssd dx db {dtype} {head_dim} {parts}"] = build(ssd_bwd._dx_db_kernel, dict(
                    X=ptr, B=ptr, C=ptr, D=ptr, DY=F32, DT=F32, ACUM=F32, DSTATES=F32, DX=ptr, DDT=F32, DB=F32,
                    DA_NEG=F32), dict(tiles, WITH_DX=parts[0], WITH_DB=parts[1]), warps, stages)
            shared[f"ssd dc {dtype} {head_dim}"] = build(ssd_bwd._dc_kernel, dict(
                X=ptr, B=ptr, C=ptr, DY=F32, DT=F32, ACUM=F32, STARTS=F32, DC=F32, DA_POS=F32, DSKIP=F32), tiles,
                warps, stages)
    shared["causal conv1d grad"] = build(causal_conv1d._conv_grad_kernel, dict(
        X=P, STATE=P, W=P, BIAS=P, DOUT=P, DCONV=F32, DW_PART=F32, DBIAS_PART=F32), dict(
        KERNEL=4, HAS_STATE=True, HAS_BIAS=True, BLOCK_T=64, BLOCK_C=64), 4, 3)
    shared["causal conv1d input grad"] = build(causal_conv1d._conv_input_grad_kernel, dict(
        DCONV=F32, W=P, DNEW_STATE=P, DX=P, DSTATE=P), dict(KERNEL=4, HAS_STATE=True, BLOCK_T=64, BLOCK_C=64), 4, 3)
    for indexed in (False, True):  # the indexed step: rows of the engine's state pool, in place
        shared[f"ssd state step {indexed}"] = build(ssd._state_step_kernel, dict(
            STATE=F32, ROWS="*i64", X=P, DT=P, A=F32, B=P, C=P, D=P, DT_BIAS=P, NEW_STATE=F32, Y=F32),
            dict(INDEXED=indexed, BLOCK_P=64, BLOCK_N=128), 4, 3)
    shared["causal conv1d indexed update"] = build(causal_conv1d._conv_update_indexed_kernel, dict(
        X=P, STATES=P, ROWS="*i64", W=P, BIAS=P, OUT=P), dict(KERNEL=4, HAS_BIAS=True, BLOCK_C=128, BLOCK_K=4), 4, 3)
    shared["causal conv1d"] = build(causal_conv1d._causal_conv1d_kernel, dict(
        X=P, STATE=P, W=P, BIAS=P, OUT=P, NEW_STATE=P), dict(KERNEL=4, HAS_STATE=True, HAS_BIAS=True, BLOCK_T=64,
                                                            BLOCK_C=64, BLOCK_K=4), 4, 3)
    print(json.dumps(shared))
''')

H100_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


@pytest.mark.slow  # compiles 37 kernels with ptxas: about 70 s on 2 cores
def test_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 37
    too_big = {name: size for name, size in shared.items() if size > H100_SHARED_LIMIT}
    assert not too_big, f"tiles overflow the {H100_SHARED_LIMIT} bytes of shared memory: {too_big}"
