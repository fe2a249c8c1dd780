"""PEARL's 4-token generations on the tiny models of test_pearl_tokens_have_the_targets_joint_distribution
(tests/drafters/test_clasp_pearl.py), on transformers' modules and on tierspec's own Llama forward (the same
weights saved and loaded with implementation="tierspec"): ms a generation over 200 seeds after 10, the first 8
texts of each, and the largest logit difference. One intra-op thread, as the suite runs.

    python results/zen3/stop77/pearl_forward.py
"""
import sys, time, torch, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
torch.set_num_threads(1)
from conftest import tiny_llama, as_method
from tierspec.models import load_model
from tierspec.decode import decode, DecodeConfig
from tierspec.drafters.pearl import PearlDrafter
from tierspec.drafters.model import ModelDrafter
from tierspec.rules.exact import ExactRule
from tierspec.policies import FixedLength
from tierspec.sampling import SamplingConfig
def own(m):
    d = tempfile.mkdtemp() + "/m"; m.model.save_pretrained(d); return load_model(d, dtype="float64", implementation="tierspec")
hf_t = tiny_llama(seed=11, vocab_size=5, layers=2, hidden=16, sharpness=4.0)
hf_d = tiny_llama(seed=12, vocab_size=5, layers=1, hidden=16, sharpness=4.0)
own_t, own_d = own(hf_t), own(hf_d)
prompt = torch.tensor([1, 2, 3, 4]); sampling = SamplingConfig(1.0)
for label, t, d in (("hf", hf_t, hf_d), ("own", own_t, own_d)):
    pearl = PearlDrafter(ModelDrafter(d.model), gamma=2, threads=0)
    method = as_method(pearl, ExactRule("residual"), FixedLength(3))
    outs = []
    def run(n):
        for seed in range(n):
            o = []
            for step in decode(t, method, prompt, DecodeConfig(max_new_tokens=4, sampling=sampling), seed): o += step.new_tokens
            outs.append(o)
    run(10); outs.clear()
    s = time.perf_counter(); run(200); print(label, "ms per generation", 5 * (time.perf_counter() - s))
    print(label, outs[:8])
with torch.inference_mode():
    x = torch.tensor([[1, 2, 3, 4, 0]])
    print("max logit diff", (hf_t.model(x).logits - own_t.model(x).logits).abs().max().item())
