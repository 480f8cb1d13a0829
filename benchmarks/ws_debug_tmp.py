import sys, torch
from benchmarks.common import packed_qkv
from benchmarks.probe_gluon_attention import tile_config
import importlib
va = importlib.import_module("kernels.varlen_attention")
d = int(sys.argv[1]); tile = sys.argv[2]; lengths = eval(sys.argv[3])
qkv, cu = packed_qkv(lengths, d, torch.Generator(device="cuda").manual_seed(0))
q, k, v = qkv.unbind(1)
ref = va.reference_varlen_attention(q, k, v, cu)
c = tile_config(tile)
o = va.triton_varlen_attention(q, k, v, cu, max(lengths), config=c)
torch.cuda.synchronize()
print(tile, lengths[:4], len(lengths), "rel err", ((o.float() - ref).norm() / ref.norm()).item(), flush=True)
