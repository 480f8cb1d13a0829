import sys, torch, json; sys.path.insert(0, ".")
from kernels.varlen_attention import triton_varlen_attention, reference_varlen_attention
from kernels.qkv_rope import qkv_rope_
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq, apply_vision_rope
from benchmarks.common import bench
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
res = {}
for D in (72, 80):
  for name, lens in [("1x16384",[16384]),("32x784",[784]*32),("mixed8",[256,784,1024,2304,4096,576,1600,3136]),("64x256",[256]*64)]:
    T=sum(lens); cu=torch.tensor([0]+lens,device="cuda").cumsum(0).int(); H=16
    qkv=torch.randn(T,3,H,D,device="cuda",dtype=torch.bfloat16); q,k,v=qkv.unbind(1)
    fl=4*sum(n*n for n in lens)*H*D
    row={}
    try:
        o=triton_varlen_attention(q,k,v,cu,max(lens),v_transposed=True); torch.cuda.synchronize()
        if name != "1x16384":
            r=reference_varlen_attention(q,k,v,cu); row["vt_err"]=((o.float()-r).norm()/r.norm()).item()
        row["vt"]=fl/bench(lambda: triton_varlen_attention(q,k,v,cu,max(lens),v_transposed=True))/1e9
    except Exception as e: row["vt"]=repr(e)[:100]
    row["dv64"]=fl/bench(lambda: triton_varlen_attention(q,k,v,cu,max(lens)))/1e9
    if len(set(lens))==1:
        qb,kb,vb=(t.view(len(lens),lens[0],H,D).transpose(1,2).contiguous() for t in (q,k,v))
        def c():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): return F.scaled_dot_product_attention(qb,kb,vb)
        row["cudnn_batched"]=fl/bench(c)/1e9
    res[f"d{D} {name}"]=row; print(D, name, row, flush=True)
pos=torch.randint(0,64,(25088,2),device="cuda"); cos,sin=vision_rope_cos_sin(pos, vision_rope_inv_freq(64,device="cuda"))
qkv=torch.randn(25088,3,16,64,device="cuda",dtype=torch.bfloat16); a=qkv.clone(); qkv_rope_(a,cos,sin)
print("rope exact:", torch.equal(a[:,0], apply_vision_rope(qkv[:,0],cos,sin)), torch.equal(a[:,1], apply_vision_rope(qkv[:,1],cos,sin)), "ms", bench(lambda: qkv_rope_(a,cos,sin)))
import os; json.dump(res, open(os.environ["OUT"]+"/vt.json","w"), indent=1)
