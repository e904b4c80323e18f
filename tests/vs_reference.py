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


def fro_err(a, b):
    """||a - b||_F / ||b||_F: the relative error of a whole tensor."""
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


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

    def test_decay_exponents(self):
        """A config's decay_exponents reach both sides (the fast heads' logits would differ otherwise)."""
        with open(os.path.join(SRC, "configs", "laplace-tiny.json")) as f:
            cfg = json.load(f)
        cfg["decay_exponents"] = [5, 9, 14, 20][:cfg["num_heads"]] + [20] * max(0, cfg["num_heads"] - 4)
        cfg["name"] = "decay_exponents"
        self.check(cfg, B=2, T=150, seed=3)


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


def structured_tokens(n, V, seed):
    """A token stream with learnable structure (a sparse random Markov chain), so that
    training losses fall and per-step comparisons see real optimisation, not noise."""
    rng = np.random.RandomState(seed)
    succ = rng.randint(0, V, size=(V, 3))
    out = np.empty(n, dtype=np.int64)
    t = 0
    for i in range(n):
        out[i] = t
        t = succ[t, rng.randint(0, 3)] if rng.rand() > 0.05 else rng.randint(0, V)
    return out


def tiny_config():
    with open(os.path.join(SRC, "configs", "laplace-tiny.json")) as f:
        return json.load(f)


class GradientsVsAutograd(unittest.TestCase):
    """SPEC §2: the whole model's fp32 gradients vs PyTorch autograd of the reference.

    Every parameter's gradient must be within 1e-5 relative (Frobenius norm of the difference
    over the norm of the reference) of the reference's autograd gradient evaluated in fp64, the
    exact value for these weights; the max-abs error normalised by the max must be within 1e-4.
    The reference's own fp32 autograd is compared too, at 2e-5: it is itself up to 1.5e-5 away
    from the fp64 gradient (its reductions run in other orders), so it cannot be the judge at 1e-5.
    """

    def check(self, cfg_dict, B, T, seed):
        with tempfile.TemporaryDirectory() as tmp:
            d, cfg = make_model_dir(tmp, cfg_dict, seed)
            shard = os.path.join(tmp, "data.bin")
            ref.write_shard(shard, structured_tokens(B * T + 1, cfg.V, seed))
            out = os.path.join(tmp, "grads.safetensors")
            laplace("debug", "grad", "--model", d, "--data", shard, "--batch", str(B), "--seq", str(T), "--out", out)
            cpp = ref.read_safetensors(out)
            grads = {}
            for dt in ("f32", "f64"):
                model = ref.load_model(cfg, os.path.join(d, "model.safetensors"), dt)
                x, y = ref.DataLoader(ref.read_shard(shard), B, T).next_batch()
                logits, _ = model(x, mixer="chunked")
                ref.loss_fn(logits, y).backward()
                grads[dt] = {n: p.grad for n, p in model.named()}
            worst = worst_max = worst_t32 = 0.0
            for name, exact in grads["f64"].items():
                err, err_max = fro_err(cpp[name], exact), rel_err(cpp[name], exact)
                err_t32 = fro_err(cpp[name], grads["f32"][name])
                worst, worst_max, worst_t32 = max(worst, err), max(worst_max, err_max), max(worst_t32, err_t32)
                self.assertLessEqual(err, 1e-5, name)
                self.assertLessEqual(err_max, 1e-4, name)
                self.assertLessEqual(err_t32, 2e-5, name)
            print("\n  worst per-tensor gradient error vs fp64 autograd %.3g (Frobenius), %.3g (max-abs); "
                  "vs fp32 autograd %.3g" % (worst, worst_max, worst_t32))

    def test_tiny(self):
        self.check(tiny_config(), B=2, T=100, seed=5)

    def test_real_head_dims(self):
        self.check(REAL_HEADS, B=1, T=150, seed=6)


class GlaVsAutograd(unittest.TestCase):
    """The chunked GLA kernel's outputs and dq, dk, dv, d(initial state) vs autograd."""

    def test_real_dims_with_initial_state(self):
        for dtype, tol in (("f64", 1e-10), ("f32", 1e-5)):
            tdt = torch.float64 if dtype == "f64" else torch.float32
            g = torch.Generator().manual_seed(0)
            B, T, H, dk, dv = 2, 200, 2, 96, 192
            t = {n: torch.randn(*sh, generator=g, dtype=torch.float64).to(tdt) for n, sh in (
                ("q", (B, T, H, dk)), ("k", (B, T, H, dk)), ("v", (B, T, H, dv)), ("s0", (B, H, dk, dv)),
                ("do", (B, T, H, dv)))}
            lam = ref.head_decays(H)
            with tempfile.TemporaryDirectory() as tmp:
                inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
                ref.write_safetensors(inp, dict(t, decay=lam.double()))
                laplace("debug", "gla", "--in", inp, "--out", out, "--chunk", "64", "--dtype", dtype)
                cpp = ref.read_safetensors(out)
            leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "s0")}
            o, s1 = ref.gla_chunked(leaves["q"], leaves["k"], leaves["v"], lam, 1.0 / dk ** 0.5,
                                    S0=leaves["s0"], chunk=64)
            (o * t["do"]).sum().backward()
            self.assertLessEqual(rel_err(cpp["o"], o.detach()), tol)
            self.assertLessEqual(rel_err(cpp["s_final"], s1.detach()), tol)
            for n, key in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("s0", "ds0")):
                self.assertLessEqual(rel_err(cpp[key], leaves[n].grad), tol, key + " " + dtype)


class NewtonSchulzVsReference(unittest.TestCase):
    def test_shapes(self):
        for shape in ((64, 32), (32, 64), (96, 96), (9, 40)):
            G = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
            with tempfile.TemporaryDirectory() as tmp:
                inp, out = os.path.join(tmp, "g.safetensors"), os.path.join(tmp, "o.safetensors")
                ref.write_safetensors(inp, {"G": G})
                laplace("debug", "ns", "--in", inp, "--out", out)
                cpp = ref.read_safetensors(out)["O"]
            self.assertLessEqual(rel_err(cpp, ref.newton_schulz(G)), 1e-5, str(shape))


class TrainingTracksReference(unittest.TestCase):
    """20 steps of laplace-tiny (Muon + AdamW, warm-up + cosine, clipping, weight decay) follow the
    reference trained on the same data from the same checkpoint within 1e-3 relative loss per step."""

    def test_20_steps(self):
        B, T, steps = 4, 64, 20
        with tempfile.TemporaryDirectory() as tmp:
            d, cfg = make_model_dir(tmp, tiny_config(), 8, spread=False)
            shard = os.path.join(tmp, "data.bin")
            ref.write_shard(shard, structured_tokens(B * T * steps + 1, cfg.V, 8))
            out = os.path.join(tmp, "run")
            args = dict(lr=0.01, warmup=5, wd=0.1, max_grad_norm=1.0)
            laplace("train", "--config", os.path.join(d, "config.json"), "--init", os.path.join(d, "model.safetensors"),
                    "--data", shard, "--no-shuffle", "--steps", str(steps), "--batch", str(B), "--seq", str(T),
                    "--lr", str(args["lr"]), "--warmup", str(args["warmup"]), "--schedule", "cosine",
                    "--wd", str(args["wd"]), "--max-grad-norm", str(args["max_grad_norm"]), "--out", out, "--quiet",
                    "--documents", "packed")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                cpp = [json.loads(l)["loss"] for l in f if '"loss"' in l]
            hist, _ = ref.train(cfg, ref.read_safetensors(os.path.join(d, "model.safetensors")),
                                ref.read_shard(shard), steps, B, T, args["lr"], warmup=args["warmup"],
                                schedule="cosine", wd=args["wd"], max_grad_norm=args["max_grad_norm"])
            want = [h["loss"] for h in hist]
            self.assertEqual(len(cpp), steps)
            errs = [abs(a - b) / abs(b) for a, b in zip(cpp, want)]
            print("\n  losses C++ %.4f -> %.4f, reference %.4f -> %.4f; worst relative gap %.2e"
                  % (cpp[0], cpp[-1], want[0], want[-1], max(errs)))
            self.assertLess(cpp[-1], cpp[0] - 0.5)  # it learns
            for s, e in enumerate(errs):
                self.assertLessEqual(e, 1e-3, "step %d: C++ %.6f vs reference %.6f" % (s, cpp[s], want[s]))


class TrainingWithDocumentsApartTracksReference(unittest.TestCase):
    """`laplace train --documents separate` (the default) against the reference keeping documents apart
    (Laplace.forward's document_separator) on a stream with a separator (2) every 3 to 60 tokens, so most
    windows hold several documents, some one-token ones: 10 steps within 1e-3 relative loss per step. The
    same run with --documents packed misses that bound (measured 2.8e-3 against 1.3e-5: the test can fail)."""

    def test_10_steps(self):
        B, T, steps, sep = 4, 64, 10, 2
        with tempfile.TemporaryDirectory() as tmp:
            d, cfg = make_model_dir(tmp, tiny_config(), 8, spread=False)
            toks = structured_tokens(B * T * steps + 1, cfg.V, 9)
            toks[toks == sep] = sep + 1
            rng = np.random.RandomState(3)
            pos = 0
            while pos < len(toks):
                toks[pos] = sep
                pos += int(rng.choice([1, 3, 17, 40, 60]))
            shard = os.path.join(tmp, "data.bin")
            ref.write_shard(shard, toks)
            common = ["--config", os.path.join(d, "config.json"), "--init", os.path.join(d, "model.safetensors"),
                      "--data", shard, "--no-shuffle", "--steps", str(steps), "--batch", str(B), "--seq", str(T),
                      "--lr", "0.01", "--warmup", "3", "--schedule", "cosine", "--wd", "0.1",
                      "--max-grad-norm", "1.0", "--quiet"]
            losses = {}
            for mode in ("separate", "packed"):
                out = os.path.join(tmp, mode)
                laplace("train", *common, "--out", out, "--documents", mode)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    losses[mode] = [json.loads(l)["loss"] for l in f if '"loss"' in l]
            hist, _ = ref.train(cfg, ref.read_safetensors(os.path.join(d, "model.safetensors")),
                                ref.read_shard(shard), steps, B, T, 0.01, warmup=3, schedule="cosine", wd=0.1,
                                max_grad_norm=1.0, document_separator=sep)
            want = [h["loss"] for h in hist]
            errs = [abs(a - b) / abs(b) for a, b in zip(losses["separate"], want)]
            packed_errs = [abs(a - b) / abs(b) for a, b in zip(losses["packed"], want)]
            print("\n  documents apart: worst relative gap %.2e (packed against the same reference: %.2e)"
                  % (max(errs), max(packed_errs)))
            self.assertEqual(len(losses["separate"]), steps)
            for s, e in enumerate(errs):
                self.assertLessEqual(e, 1e-3, "step %d: C++ %.6f vs reference %.6f" % (s, losses["separate"][s], want[s]))
            self.assertGreater(max(packed_errs), 1e-3)  # a run that ignored the boundaries would fail


class ReferenceTrainerTracksLaplaceTrain(unittest.TestCase):
    """python/reference_trainer.py (the parity run's reference on the GPU) against `laplace train` on the
    CPU in f32: two shards crossed and wrapped around, gradient accumulation, validation lines, and a
    resume of the reference in the middle. Every training and validation loss within 1e-3 relative (at
    this learning rate f32 rounding differences grow to ~1e-4 by step 8; a batch read from the wrong
    place differs by ~1e-2)."""

    def test_losses_and_val_losses_agree(self):
        B, T, accum, steps = 2, 64, 2, 14
        with tempfile.TemporaryDirectory() as tmp:
            d, cfg = make_model_dir(tmp, tiny_config(), 3, spread=False)
            # Shard sizes make the sequential reader leave shard 0 after 5 micro-batches, shard 1
            # after 4, and wrap to the first shard again within the run.
            toks = structured_tokens(B * T * 12 + 40, cfg.V, 5)
            ref.write_shard(os.path.join(tmp, "train_000000.bin"), toks[:B * T * 5 + 1 + 20])
            ref.write_shard(os.path.join(tmp, "train_000001.bin"), toks[B * T * 6:])
            ref.write_shard(os.path.join(tmp, "val_000000.bin"), toks[7:B * T * 3 + 8])
            hp = ["--batch", str(B), "--seq", str(T), "--grad-accum", str(accum), "--steps", str(steps),
                  "--lr", "0.01", "--warmup", "3", "--wd", "0.1", "--max-grad-norm", "1.0",
                  "--eval-every", "5", "--eval-batches", "2"]
            data = ["--data", os.path.join(tmp, "train_*.bin"), "--val-data", os.path.join(tmp, "val_*.bin")]
            init = ["--config", os.path.join(d, "config.json"), "--init", os.path.join(d, "model.safetensors")]
            ours, theirs = os.path.join(tmp, "ours"), os.path.join(tmp, "ref")
            laplace("train", *init, *data, *hp, "--no-shuffle", "--out", ours, "--quiet", "--documents", "packed")
            rt = [sys.executable, os.path.join(SRC, "python", "reference_trainer.py"), *init, *data, *hp,
                  "--out", theirs, "--amp", "none", "--ns-mode", "fp32", "--device", "cpu"]
            for extra in (["--stop-after", "6"], ["--resume"]):
                r = subprocess.run(rt + extra, capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

            def read(path):
                with open(os.path.join(path, "metrics.jsonl")) as f:
                    rows = [json.loads(l) for l in f]
                return ([r["loss"] for r in rows if "loss" in r],
                        [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r])
            (a, av), (b, bv) = read(ours), read(theirs)
            self.assertEqual(len(a), steps)
            self.assertEqual(len(b), steps)
            self.assertEqual([s for s, _ in av], [4, 9])
            self.assertEqual([s for s, _ in bv], [4, 9])
            for s, (x, y) in enumerate(zip(a, b)):
                self.assertLessEqual(abs(x - y), 1e-3 * abs(y), "step %d: laplace %.7f, reference %.7f" % (s, x, y))
            for (s, x), (_, y) in zip(av, bv):
                self.assertLessEqual(abs(x - y), 1e-3 * abs(y), "val at %d: laplace %.7f, reference %.7f" % (s, x, y))
            self.assertLess(a[-1], a[0] - 0.3)  # it learns


if __name__ == "__main__":
    unittest.main()
