import sys, os, subprocess, math
from concurrent.futures import ThreadPoolExecutor
CFGS=[(128,64,4,3),(128,64,8,3),(128,128,8,3),(128,128,8,2),(64,64,4,3),(128,32,4,4),(64,128,4,3),(128,64,4,4),(128,64,8,2),(128,128,4,2)]
if len(sys.argv) > 1:
    import torch, triton
    sys.path.insert(0, ".")
    from kernels.varlen_attention import _varlen_attn_fwd, reference_varlen_attention
    from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq
    bm,bn,w,s,d1w,dv1 = map(int, sys.argv[1:]); k1t=0
    H=16; res=[]
    for D in (72, 80):
      for lengths in ([1], [200], [5, 1000, 77]):
        for rope in ((0,) if k1t else (0, 1)):
            T=sum(lengths); L=max(lengths)
            qkv=torch.randn(T,3,H,D,device="cuda",dtype=torch.bfloat16); q,k,v=qkv.unbind(1)
            cu=torch.tensor([0]+lengths,device="cuda").cumsum(0).to(torch.int32)
            out=torch.full((T,H,D), float('nan'), device="cuda", dtype=torch.bfloat16)
            d0,d1=64,d1w
            pos=torch.randint(0,64,(T,2),device="cuda"); cos,sin=vision_rope_cos_sin(pos, vision_rope_inv_freq(D,device="cuda"))
            args=(q,k,v,out,cu,cos if rope else q, sin if rope else q, q.stride(0),q.stride(1),k.stride(0),k.stride(1),v.stride(0),v.stride(1),out.stride(0),out.stride(1),cos.stride(0) if rope else 0, D**-0.5*math.log2(math.e), 0)
            _varlen_attn_fwd[(triton.cdiv(L,bm),H,len(lengths))](*args, HEAD_DIM=D,D0=d0,REM=True,D1=d1,DV1=dv1,BLOCK_M=bm,BLOCK_N=bn,ROPE=bool(rope),num_warps=w,num_stages=s)
            torch.cuda.synchronize()
            ref=reference_varlen_attention(q,k,v,cu,cos=cos if rope else None,sin=sin if rope else None)
            e=(out.float()-ref).norm().item()/ref.norm().item()
            res.append(f"{D}/{len(lengths)}/{rope}:{'ok' if e<1e-2 else 'BAD%.1e'%e}")
    print(" ".join(res))
else:
    def one(cfg):
        r=subprocess.run([sys.executable, __file__, *map(str,cfg)],capture_output=True,text=True)
        return cfg, (r.stdout.strip() or "CRASH " + (r.stderr.strip().splitlines() or [""])[-1][:80])
    jobs=[c+v for v in [(16,64),(32,64),(64,16),(64,32),(64,64)] for c in [(128,64,4,3),(128,64,8,3),(128,128,8,2),(64,64,4,3)]]
    with ThreadPoolExecutor(8) as ex:
        for cfg, msg in ex.map(one, jobs):
            print(cfg, msg, flush=True)
