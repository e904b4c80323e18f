"""C++ (CPU backend) vs the PyTorch executable spec (python/laplace_ref.py).

Both sides load the same checkpoint files. Run by ctest with LAPLACE_BINARY set:
    /usr/bin/python3 -m unittest -v tests/vs_reference.py
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import laplace_ref as ref  # noqa: E402

BINARY = os.environ.get("LAPLACE_BINARY", os.path.join(HERE, "..", "build", "laplace"))
SRC = os.path.join(HERE, "..")

# A 2-layer model with laplace-3b's head shapes (H=2, dk=96, dv=192).
REAL_HEADS = dict(model_type="laplace", vocab_size=512, hidden_size=192, num_layers=2, num_heads=2,
                  head_k_dim=96, head_v_dim=192, ffn_size=768, conv_size=4, chunk_size=128,
                  norm_eps=1e-5, tie_embeddings=False)


def laplace(*args):
    r = subprocess.run([BINARY, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError("laplace %s failed (%d):\n%s%s" % (" ".join(args), r.returncode, r.stdout, r.stderr))
    return r.stdout


def rel_err(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_model_dir(tmp, cfg_dict, seed, spread=True):
    """Writes config.json + model.safetensors. With `spread`, weights are drawn larger than the
    training init so that logits are O(1) apart: greedy comparisons then test the model, not ties."""
    d = os.path.join(tmp, "m%d" % seed)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    cfg = ref.load_config(os.path.join(d, "config.json"))
    params = ref.init_params(cfg, seed)
    if spread:
        rng = np.random.RandomState(seed + 1)
        for name, t in params.items():
            if t.dim() == 2 and "conv" not in name:
                fan_in = t.shape[1]
                params[name] = torch.from_numpy(rng.standard_normal(tuple(t.shape)) / np.sqrt(fan_in)).float()
            elif t.dim() == 1:
                params[name] = (t + torch.from_numpy(0.1 * rng.standard_normal(tuple(t.shape))).float())
        params["lm_head.weight"] *= 3.0
    ref.write_safetensors(os.path.join(d, "model.safetensors"), params)
    return d, cfg


class LogitsVsReference(unittest.TestCase):
    def check(self, cfg_dict, B, T, seed):
        with tempfile.TemporaryDirectory() as tmp:
            d, cfg = make_model_dir(tmp, cfg_dict, seed)
            rng = np.random.RandomState(seed)
            toks = rng.randint(0, cfg_dict["vocab_size"], size=(B, T))
            spec = ";".join(",".join(str(int(x)) for x in row) for row in toks)
            out = os.path.join(tmp, "cpp.safetensors")
            laplace("forward", "--model", d, "--tokens", spec, "--out", out)
            cpp = ref.read_safetensors(out)["logits"]
            model = ref.load_model(cfg, os.path.join(d, "model.safetensors"), "f32")
            with torch.no_grad():
                want, _ = model(torch.tensor(toks, dtype=torch.int64), mixer="chunked")
            err = rel_err(cpp, want)
            print("\n  %s B=%d T=%d: max relative logits error %.3g" % (cfg_dict.get("name", ""), B, T, err))
            self.assertLessEqual(err, 1e-5)

    def test_tiny(self):
        with open(os.path.join(SRC, "configs", "laplace-tiny.json")) as f:
            cfg = json.load(f)
        self.check(cfg, B=2, T=150, seed=1)  # T not a multiple of the chunk size

    def test_real_head_dims(self):
        self.check(REAL_HEADS, B=2, T=200, seed=2)


class GreedyVsReference(unittest.TestCase):
    def test_64_greedy_tokens_identical(self):
        with open(os.path.join(SRC, "configs", "laplace-tiny.json")) as f:
            tiny = json.load(f)
        for cfg_dict, seed in ((REAL_HEADS, 3), (tiny, 4)):
            with tempfile.TemporaryDirectory() as tmp:
                d, cfg = make_model_dir(tmp, cfg_dict, seed)
                prompt = [int(x) for x in np.random.RandomState(seed).randint(0, cfg.V, size=37)]
                out = laplace("generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-tokens", "64", "--prefill-chunk", "16")
                line = [l for l in out.splitlines() if l.startswith("ids=")][0]
                cpp = [int(x) for x in line[4:].split(",")]
                model = ref.load_model(cfg, os.path.join(d, "model.safetensors"), "f32")
                want = ref.generate(model, prompt, 64)
                self.assertEqual(len(cpp), 64)
                self.assertEqual(cpp, want)


if __name__ == "__main__":
    unittest.main()
