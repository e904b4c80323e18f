"""Tests of the `laplace` package (python/laplace) against the executable spec (laplace_ref.py).

Run from the repo root: /usr/bin/python3 -m unittest -v python/test_package.py
Runs on Debian's torch 1.13 without transformers: the model, its cache, gradients, bf16, loading and the
error cases. With LAPLACE_BINARY set (ctest sets it): `laplace export hf` and C++-vs-package logits. The parts
that need transformers (Auto classes, generate(), trust_remote_code) and sentencepiece (the tokenizer) skip
with a message when those packages are missing; scripts/device/hf_check.py covers them on the GPU machine.
"""
import importlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import types
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import laplace  # noqa: E402
import laplace_ref as lr  # noqa: E402
from laplace import modeling_laplace as ml  # noqa: E402

torch.set_num_threads(2)

TINY = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, head_k_dim=8, head_v_dim=16,
            ffn_size=64, conv_size=4, chunk_size=16)
LAPLACE_BINARY = os.environ.get("LAPLACE_BINARY", "")
try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False
try:
    import sentencepiece as spm
except ImportError:
    spm = None
NO_TRANSFORMERS = "transformers is not installed (Debian has no python3-transformers): the transformers parts " \
                  "run in scripts/device/hf_check.py on the GPU machine"


def rand_params(cfg, seed, big=True):
    """laplace_ref.init_params, with larger matrices so the GLA and conv paths matter in the logits."""
    p = lr.init_params(cfg, seed)
    if big:
        g = torch.Generator().manual_seed(seed + 100)
        for n, t in p.items():
            if t.dim() == 2 and not n.endswith("conv.weight"):
                p[n] = t * 5.0
            elif n.endswith(("norm1.weight", "norm2.weight", "onorm.weight")):
                p[n] = t + 0.3 * torch.randn(t.shape, generator=g)
    return p


def pair(seed=0, big=True, **over):
    """(laplace_ref.Laplace, laplace.LaplaceForCausalLM) with the same weights."""
    kw = dict(TINY, **over)
    rc = lr.Config(**kw)
    params = rand_params(rc, seed, big)
    model = laplace.LaplaceForCausalLM(laplace.LaplaceConfig(**kw))
    model.load_state_dict(params, strict=True)
    return lr.Laplace(rc, params), model.eval(), params


def tokens(B, T, V=97, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def write_model_dir(path, cfg_dict, params):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg_dict, model_type="laplace"), f, indent=2)
    lr.write_safetensors(os.path.join(path, "model.safetensors"), params)


class TestModelVsReference(unittest.TestCase):
    def test_logits_f32(self):
        for T, over in ((45, {}), (150, dict(chunk_size=64)), (7, {}), (1, {}), (33, dict(tie_embeddings=True)),
                        (45, dict(decay_exponents=[6, 20]))):
            ref, model, _ = pair(1, **over)
            x = tokens(2, T, seed=T)
            with torch.no_grad():
                a, sa = ref(x)
                out = model(x, use_cache=True)
            self.assertLess(float((out.logits - a).abs().max()), 1e-5, (T, over))
            self.assertGreater(float(a.abs().max()), 1.0)  # not a trivially small output
            for i, (S, w) in enumerate(out.past_key_values):
                self.assertLess(float((S - sa[i][0]).abs().max()), 1e-5)
                self.assertLess(float((w - sa[i][1]).abs().max()), 1e-6)

    def test_logits_f64_and_forms(self):
        ref, model, _ = pair(2)
        ref, model = ref.double(), model.double()
        x = tokens(2, 70, seed=3)
        with torch.no_grad():
            out = model(x).logits
            for mixer in ("chunked", "quadratic", "recurrent"):
                a, _ = ref(x, mixer=mixer)
                self.assertLess(float((out - a).abs().max() / a.abs().max()), 1e-12, mixer)

    def test_decode_after_prefill_equals_full_forward(self):
        ref, model, _ = pair(3)
        x = tokens(2, 60, seed=4)
        with torch.no_grad():
            full = model(x).logits
            for split in (1, 16, 37):
                out = model(x[:, :split], use_cache=True)
                cache, steps = out.past_key_values, [out.logits]
                for t in range(split, 60):
                    o = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
                    self.assertIs(o.past_key_values, cache)
                    steps.append(o.logits)
                self.assertEqual(cache.get_seq_length(), 60)
                self.assertLess(float((torch.cat(steps, 1) - full).abs().max()), 1e-5, split)
            # prefill in two chunked pieces, then decode
            o1 = model(x[:, :23], use_cache=True)
            o2 = model(x[:, 23:50], past_key_values=o1.past_key_values, use_cache=True)
            self.assertLess(float((o2.logits - full[:, 23:50]).abs().max()), 1e-5)

    def test_cache_is_constant_size(self):
        _, model, _ = pair(4)
        cfg = model.config
        with torch.no_grad():
            short = model(tokens(3, 5), use_cache=True).past_key_values
            long = model(tokens(3, 400), use_cache=True).past_key_values
        self.assertEqual(short.nbytes(), long.nbytes())
        self.assertEqual(long.nbytes(), 3 * cfg.state_bytes_per_sequence())
        for S, w in long:
            self.assertEqual(tuple(S.shape), (3, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim))
            self.assertEqual(tuple(w.shape), (3, cfg.conv_size, cfg.hidden_size))
            self.assertEqual((S.dtype, w.dtype), (torch.float32, torch.float32))
        # 3B: 29,491,200 bytes per sequence (SPEC §1)
        c3b = laplace.LaplaceConfig(vocab_size=92160, hidden_size=3072, num_layers=24, num_heads=16, head_k_dim=96,
                                    head_v_dim=192, ffn_size=8192)
        self.assertEqual(c3b.state_bytes_per_sequence(), 29491200)

    def test_initial_state_from_reference(self):
        ref, model, _ = pair(5)
        x = tokens(2, 40, seed=6)
        with torch.no_grad():
            _, st = ref(x[:, :25])
            a, _ = ref(x[:, 25:], state=st)
            cache = ml.LaplaceCache.from_tensors(lr.state_to_tensors(st), 2, seen_tokens=25)
            b = model(x[:, 25:], past_key_values=cache).logits
        self.assertLess(float((a - b).abs().max()), 1e-5)

    def test_greedy_tokens_equal_reference_generate(self):
        ref, model, _ = pair(6, big=False)
        prompt = [5, 17, 42, 3, 88, 1]
        want = lr.generate(ref, prompt, 24)
        ids = torch.tensor([prompt])
        cache, got = None, []
        with torch.no_grad():
            while len(got) < 24:  # what generate() does: prepare_inputs_for_generation feeds the unseen tokens
                inp = model.prepare_inputs_for_generation(ids, past_key_values=cache)
                self.assertEqual(inp["input_ids"].shape[1], ids.shape[1] if cache is None else 1)
                out = model(**inp)
                cache = out.past_key_values
                nxt = int(out.logits[0, -1].argmax())
                got.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        self.assertEqual(got, want)

    def test_gradients_equal_reference(self):
        ref, model, _ = pair(7)
        x = tokens(2, 40, seed=8)
        a, _ = ref(x)
        lr.loss_fn(a[:, :-1], x[:, 1:]).backward()
        model.train()
        out = model(x, labels=x)
        out.loss.backward()
        self.assertLess(abs(float(out.loss) - float(lr.loss_fn(a[:, :-1], x[:, 1:]))), 1e-5)
        self.assertIsNone(out.past_key_values)  # no cache by default in training
        for name, p in ref.named():
            g = dict(model.named_parameters())[name].grad
            self.assertIsNotNone(g, name)
            rel = float((g - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30))
            self.assertLess(rel, 1e-4, name)

    def test_labels_ignore_index_and_num_items(self):
        _, model, _ = pair(8)
        x = tokens(2, 20, seed=9)
        y = x.clone()
        y[:, 10:] = -100
        with torch.no_grad():
            out = model(x, labels=y)
            lg = out.logits
            want = torch.nn.functional.cross_entropy(lg[:, :9].reshape(-1, 97), x[:, 1:10].reshape(-1))
            self.assertLess(abs(float(out.loss) - float(want)), 1e-6)
            s = model(x, labels=y, num_items_in_batch=18).loss
            self.assertLess(abs(float(s) - float(want)), 1e-6)

    def test_gradient_checkpointing_same_gradients(self):
        _, model, _ = pair(9)
        x = tokens(2, 30, seed=10)
        model.train()
        model(x, labels=x).loss.backward()
        g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        model.model.gradient_checkpointing = True
        model(x, labels=x).loss.backward()
        for n, p in model.named_parameters():
            self.assertLess(float((p.grad - g0[n]).abs().max()), 1e-6, n)

    def test_state_gradient_tbptt(self):
        """A cache carried between training segments passes gradients to the first segment."""
        _, model, _ = pair(10)
        x = tokens(1, 40, seed=11)
        model.train()
        o1 = model(x[:, :20], labels=x[:, :20], use_cache=True)
        o2 = model(x[:, 20:], labels=x[:, 20:], past_key_values=o1.past_key_values, use_cache=True)
        o2.loss.backward()
        self.assertGreater(float(model.model.embed.weight.grad[x[0, :20]].abs().sum()), 0)
        d = o2.past_key_values.detach()
        self.assertFalse(d[0][0].requires_grad)

    def test_left_padding_is_exact(self):
        _, model, _ = pair(11)
        a, b = tokens(1, 9, seed=12), tokens(1, 5, seed=13)
        pad = torch.full((1, 4), 3, dtype=torch.long)
        batch = torch.cat([a, torch.cat([pad, b], 1)], 0)
        mask = torch.ones_like(batch)
        mask[1, :4] = 0
        with torch.no_grad():
            out = model(batch, attention_mask=mask, use_cache=True)
            alone = model(b, use_cache=True)
            self.assertLess(float((out.logits[1, 4:] - alone.logits[0]).abs().max()), 1e-5)
            self.assertLess(float((out.logits[0] - model(a).logits[0]).abs().max()), 1e-5)
            # and decoding continues from the same state
            nxt = torch.tensor([[7], [7]])
            m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            o = model(nxt, attention_mask=m2, past_key_values=out.past_key_values, use_cache=True)
            o_alone = model(nxt[1:], past_key_values=alone.past_key_values, use_cache=True)
            self.assertLess(float((o.logits[1] - o_alone.logits[0]).abs().max()), 1e-5)

    def test_bf16_weights_fp32_state(self):
        _, model, _ = pair(12, big=False)
        x = tokens(2, 40, seed=14)
        with torch.no_grad():
            f32 = model(x).logits
            mb = model.to(torch.bfloat16)
            out = mb(x, use_cache=True)
        self.assertEqual(out.logits.dtype, torch.bfloat16)
        for S, w in out.past_key_values:
            self.assertEqual((S.dtype, w.dtype), (torch.float32, torch.float32))
        rel = float((out.logits.float() - f32).abs().max() / f32.abs().max())
        self.assertLess(rel, 5e-2)
        mb.train()
        loss = mb(x, labels=x).loss
        self.assertEqual(loss.dtype, torch.float32)
        loss.backward()
        self.assertTrue(all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in mb.parameters()))

    def test_prepare_inputs_for_generation(self):
        _, model, _ = pair(13)
        ids = tokens(1, 12)
        with torch.no_grad():
            cache = model(ids[:, :11], use_cache=True).past_key_values
        inp = model.prepare_inputs_for_generation(ids, past_key_values=cache)
        self.assertEqual(inp["input_ids"].tolist(), ids[:, 11:].tolist())
        inp = model.prepare_inputs_for_generation(ids, past_key_values=cache, next_sequence_length=1)
        self.assertEqual(inp["input_ids"].shape[1], 1)
        inp = model.prepare_inputs_for_generation(ids, past_key_values=None)
        self.assertEqual(inp["input_ids"].shape[1], 12)
        self.assertFalse(model._supports_default_dynamic_cache())
        with self.assertRaises(TypeError):
            model(ids, past_key_values=((torch.zeros(1),),))

    def test_fla_call_convention(self):
        """The model calls flash-linear-attention as its documented API reads (q,k,v [B,T,H,d], g_gamma = log decay
        per head, scale, initial_state / output_final_state fp32): a stand-in with those semantics, written from
        fla's docstring, gives the reference's logits. (The real kernels run in scripts/device/hf_check.py.)"""
        calls = []

        def fake_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None, **kw):
            calls.append((tuple(q.shape), initial_state is not None, output_final_state))
            B, T, H, K = q.shape
            h = torch.zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.clone()
            self.assertEqual(h.dtype, torch.float32)
            outs = []
            for t in range(T):
                kv = k[:, t, :, :, None].float() * v[:, t, :, None, :].float()
                h = h * torch.exp(g_gamma)[None, :, None, None] + kv
                outs.append(((q[:, t].float() * scale)[..., None] * h).sum(-2))
            return torch.stack(outs, 1).to(q.dtype), (h if output_final_state else None)

        saved = (ml._fla_chunk, ml._fla_recurrent, ml.gla_backend)
        ml._fla_chunk = ml._fla_recurrent = fake_simple_gla
        ml.gla_backend = lambda q: "fla"
        try:
            ref, model, _ = pair(15)
            x = tokens(2, 30, seed=16)
            with torch.no_grad():
                a, _ = ref(x)
                out = model(x[:, :20], use_cache=True)
                step = model(x[:, 20:], past_key_values=out.past_key_values, use_cache=True)
                lg = torch.cat([out.logits, step.logits], 1)
        finally:
            ml._fla_chunk, ml._fla_recurrent, ml.gla_backend = saved
        self.assertTrue(calls and calls[-1][1])
        self.assertLess(float((lg - a).abs().max()), 1e-4)

    def test_reorder_cache(self):
        _, model, _ = pair(14)
        with torch.no_grad():
            cache = model(tokens(3, 8), use_cache=True).past_key_values
        S1 = cache[1][0].clone()
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        self.assertTrue(torch.equal(cache[1][0][0], S1[2]) and torch.equal(cache[1][0][2], S1[0]))


class TestConfigAndLoading(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="laplace_pkg_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_config_aliases_and_serialisation(self):
        c = laplace.LaplaceConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                  head_k_dim=4, head_v_dim=8, intermediate_size=40)
        self.assertEqual((c.num_layers, c.num_heads, c.ffn_size), (3, 2, 40))
        self.assertEqual((c.num_hidden_layers, c.num_attention_heads, c.intermediate_size), (3, 2, 40))
        d = c.to_diff_dict()
        for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_k_dim", "head_v_dim", "ffn_size"):
            self.assertIn(k, d)
        self.assertEqual(d["model_type"], "laplace")
        self.assertNotIn("bos_token_id", d)  # never null: the C++ reader wants integers
        c.save_pretrained(self.tmp)
        with open(os.path.join(self.tmp, "config.json")) as f:
            back = json.load(f)
        self.assertEqual(lr.Config(**back).to_dict(), lr.Config(**d).to_dict())
        c2 = laplace.LaplaceConfig(**dict(TINY, eos_token_id=2))
        self.assertEqual(c2.to_diff_dict()["eos_token_id"], 2)
        self.assertEqual([n for n, _ in c.param_shapes()], [n for n, _ in lr.param_shapes(lr.Config(**d))])

    def test_remote_code_files_need_only_torch(self):
        """transformers' check of a trust_remote_code file (dynamic_module_utils.get_imports: imports outside
        try/except blocks must be installed) finds only torch and the standard library."""
        import re
        found = set()
        for f in ("configuration_laplace.py", "modeling_laplace.py"):
            with open(os.path.join(HERE, "laplace", f), encoding="utf-8") as fh:
                code = re.sub(r"\s*try\s*:.*?except.*?:", "", fh.read(), flags=re.DOTALL)
            imports = re.findall(r"^\s*import\s+(\S+)\s*$", code, flags=re.MULTILINE)
            imports += re.findall(r"^\s*from\s+(\S+)\s+import", code, flags=re.MULTILINE)
            relative = [i for i in imports if i.startswith(".")]
            self.assertTrue(set(relative) <= {".configuration_laplace"}, relative)
            found |= set(i.split(".")[0] for i in imports if not i.startswith("."))
        self.assertTrue(found <= {"torch", "copy", "json", "os", "math", "struct", "inspect", "functools"}, found)

    def test_config_errors(self):
        with self.assertRaisesRegex(ValueError, "model_type is 'llama'"):
            laplace.LaplaceConfig(**dict(TINY, model_type="llama"))
        with self.assertRaisesRegex(ValueError, "'num_heads' must be a positive integer"):
            laplace.LaplaceConfig(**dict(TINY, num_heads=0))
        with self.assertRaisesRegex(ValueError, "'tie_embeddings' must be true or false"):
            laplace.LaplaceConfig(**dict(TINY, tie_embeddings="yes"))
        with self.assertRaisesRegex(ValueError, "'decay_exponents' must be num_heads integers"):
            laplace.LaplaceConfig(**dict(TINY, decay_exponents=[5]))
        with self.assertRaisesRegex(ValueError, "'decay_exponents' has 1 entries"):
            lr.Config(**dict(TINY, decay_exponents=[5]))

    def test_reference_checkpoint_loads_and_matches(self):
        ref, _, params = pair(20)
        d = os.path.join(self.tmp, "m")
        write_model_dir(d, TINY, params)
        model = laplace.LaplaceForCausalLM.from_pretrained(d)
        x = tokens(1, 30)
        with torch.no_grad():
            self.assertLess(float((model(x).logits - ref(x)[0]).abs().max()), 1e-5)
        # bf16 checkpoint (what a bf16 save writes) loads too
        d2 = os.path.join(self.tmp, "bf16")
        write_model_dir(d2, TINY, {k: v.bfloat16() for k, v in params.items()})
        m2 = laplace.LaplaceForCausalLM.from_pretrained(d2)
        self.assertTrue(torch.equal(m2.model.embed.weight, params["model.embed.weight"].bfloat16().float()))

    def test_save_and_reload_identical(self):
        _, model, _ = pair(21)
        d = os.path.join(self.tmp, "saved")
        model.save_pretrained(d)
        back = laplace.LaplaceForCausalLM.from_pretrained(d)
        for (n, p), (n2, p2) in zip(model.state_dict().items(), back.state_dict().items()):
            self.assertEqual(n, n2)
            self.assertTrue(torch.equal(p, p2), n)
        names = set(ml.read_safetensors_header(os.path.join(d, "model.safetensors")))
        self.assertEqual(names, set(n for n, _ in model.config.param_shapes()))

    def _broken(self, edit_params=None, edit_cfg=None):
        _, _, params = pair(22)
        cfg = dict(TINY)
        if edit_params:
            edit_params(params)
        if edit_cfg:
            edit_cfg(cfg)
        d = os.path.join(self.tmp, "broken")
        shutil.rmtree(d, ignore_errors=True)
        write_model_dir(d, cfg, params)
        return d

    def test_missing_tensor_is_an_error_naming_it(self):
        d = self._broken(lambda p: p.pop("model.layers.1.w12.weight"))
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError, r"lacks tensor model\.layers\.1\.w12\.weight"):
            laplace.LaplaceForCausalLM.from_pretrained(d)

    def test_wrong_shape_is_an_error_naming_it(self):
        def bad(p):
            p["model.layers.0.wqkvg.weight"] = p["model.layers.0.wqkvg.weight"][:-1]
        d = self._broken(bad)
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError,
                                    r"model\.layers\.0\.wqkvg\.weight has shape \[95, 32\], "
                                    r"the config needs \[96, 32\]"):
            laplace.LaplaceForCausalLM.from_pretrained(d)

    def test_unexpected_tensor_is_an_error(self):
        d = self._broken(edit_cfg=lambda c: c.update(tie_embeddings=True))
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError, r"unexpected tensor lm_head\.weight"):
            laplace.LaplaceForCausalLM.from_pretrained(d)

    def test_unknown_model_type_is_an_error(self):
        d = self._broken()
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["model_type"] = "llama"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        with self.assertRaisesRegex(ValueError, "model_type is 'llama'"):
            laplace.LaplaceForCausalLM.from_pretrained(d)

    def test_no_weights_file_is_an_error(self):
        d = self._broken()
        os.remove(os.path.join(d, "model.safetensors"))
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError, "has no model.safetensors"):
            laplace.LaplaceForCausalLM.from_pretrained(d)


@unittest.skipIf(spm is None, "sentencepiece is not installed (Debian: python3-sentencepiece)")
class TestTokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="laplace_tok_")
        text = os.path.join(cls.tmp, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            for i in range(300):
                f.write("The quick brown fox %d jumps over the lazy dog. Ünïcödé text, tabs\tand spaces.\n" % i)
        prefix = os.path.join(cls.tmp, "tok")
        if LAPLACE_BINARY and os.path.exists(LAPLACE_BINARY):  # the tokenizer `laplace tokenizer train` makes
            subprocess.run([LAPLACE_BINARY, "tokenizer", "train", "--input", text, "--model-prefix", prefix,
                            "--vocab-size", "400"], check=True, stdout=subprocess.DEVNULL)
        else:  # the same SentencePiece options (text/tokenizer.cpp)
            spm.SentencePieceTrainer.train(
                input=text, model_prefix=prefix, model_type="bpe", vocab_size=400, byte_fallback=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
        cls.model_dir = os.path.join(cls.tmp, "m")
        os.makedirs(cls.model_dir)
        shutil.copy(prefix + ".model", os.path.join(cls.model_dir, "tokenizer.model"))
        cls.tok = laplace.LaplaceTokenizer.from_pretrained(cls.model_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_special_ids(self):
        t = self.tok
        self.assertEqual((t.unk_token_id, t.bos_token_id, t.eos_token_id, t.pad_token_id), (0, 1, 2, 3))
        self.assertEqual((t.eos_token, t.bos_token, t.pad_token, t.unk_token), ("</s>", "<s>", "<pad>", "<unk>"))
        self.assertEqual(t.vocab_size, 400)

    def test_round_trip_and_bytes(self):
        t = self.tok
        for s in ("The quick brown fox", "  two  spaces\nnewline", "emoji \U0001F600 and \u4e2d\u6587",
                  "a literal \u2581 marker", ""):
            ids = t.encode(s)
            self.assertNotIn(0, ids, s)  # byte fallback: never <unk>
            self.assertEqual(t.decode(ids), s)
            self.assertEqual(t.decode_bytes(ids), s.encode("utf-8"))
        ids = t.encode("a literal \u2581 marker")
        self.assertIn(t.convert_tokens_to_ids("<0xE2>"), ids)
        raw = b"bin\xff\xfe\x00ary"
        self.assertEqual(t.decode_bytes(t.encode(raw)), raw)
        self.assertEqual(t.decode(t.encode(raw)), raw.decode("utf-8", errors="replace"))
        self.assertEqual(t.decode([t.bos_token_id] + t.encode("hi") + [t.eos_token_id]), "hi")
        self.assertEqual(t.decode([1] + t.encode("hi") + [2], skip_special_tokens=False), "<s>hi</s>")
        with self.assertRaisesRegex(ValueError, "out of range"):
            t.decode([400])

    def test_call_pads_left(self):
        t = self.tok
        b = t(["The quick brown fox jumps", "dog"], return_tensors="pt", padding=True)
        ids, mask = b["input_ids"], b["attention_mask"]
        self.assertEqual(ids.shape, mask.shape)
        n = len(t.encode("dog"))
        self.assertEqual(mask[1].tolist(), [0] * (ids.shape[1] - n) + [1] * n)
        self.assertTrue((ids[1, :ids.shape[1] - n] == 3).all())
        self.assertEqual(t("dog", add_bos=True)["input_ids"][0], 1)


@unittest.skipUnless(LAPLACE_BINARY and os.path.exists(LAPLACE_BINARY),
                     "LAPLACE_BINARY is not set (ctest sets it): `laplace export hf` not tested")
class TestExportCli(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="laplace_export_")
        self.src = os.path.join(self.tmp, "src")
        cfg = os.path.join(self.tmp, "tiny.json")
        with open(cfg, "w") as f:
            json.dump(dict(TINY, model_type="laplace", vocab_size=300), f)
        self.run_cli("init", "--config", cfg, "--out", self.src, "--seed", "3")
        with open(os.path.join(self.src, "tokenizer.model"), "wb") as f:
            f.write(b"not checked by export")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_cli(self, *args, ok=True):
        r = subprocess.run([LAPLACE_BINARY] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           universal_newlines=True)
        if ok:
            self.assertEqual(r.returncode, 0, r.stdout)
        return r

    def load_exported(self, d):
        """The exported directory's own modeling_laplace.py, imported as a package (no `laplace` package)."""
        name = "exported_%d" % len(sys.modules)
        pkg = types.ModuleType(name)
        pkg.__path__ = [d]
        sys.modules[name] = pkg
        return importlib.import_module(name + ".modeling_laplace")

    def test_export_directory(self):
        out = os.path.join(self.tmp, "hf")
        r = self.run_cli("export", "hf", "--model", self.src, "--out", out)
        self.assertIn("trust_remote_code=True", r.stdout)
        self.assertEqual(sorted(os.listdir(out)), ["config.json", "configuration_laplace.py", "model.safetensors",
                                                   "modeling_laplace.py", "tokenizer.model"])
        for f in ("configuration_laplace.py", "modeling_laplace.py"):  # the package's files, byte for byte
            with open(os.path.join(out, f), "rb") as a, open(os.path.join(HERE, "laplace", f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f + " is stale: rebuild laplace")
        for f in ("model.safetensors", "tokenizer.model"):
            with open(os.path.join(out, f), "rb") as a, open(os.path.join(self.src, f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(self.src, "config.json")) as f:
            src_cfg = json.load(f)
        self.assertEqual(cfg["auto_map"], {"AutoConfig": "configuration_laplace.LaplaceConfig",
                                           "AutoModelForCausalLM": "modeling_laplace.LaplaceForCausalLM"})
        self.assertEqual(cfg["architectures"], ["LaplaceForCausalLM"])
        self.assertEqual({k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")}, src_cfg)
        # the exported file alone (plain PyTorch here) gives the C++ model's logits
        ids = "1,5,9,200,17,3,3,8,250,11,12,13,14,15,16,17,18,19,20,21,22,23"
        lg_path = os.path.join(self.tmp, "lg.safetensors")
        self.run_cli("forward", "--model", out, "--tokens", ids, "--out", lg_path)
        mod = self.load_exported(out)
        model = mod.LaplaceForCausalLM.from_pretrained(out)
        with torch.no_grad():
            lg = model(torch.tensor([[int(i) for i in ids.split(",")]])).logits
        want = ml.read_safetensors(lg_path)["logits"]
        self.assertLess(float((lg - want).abs().max()), 1e-5)
        # in place: adds the files next to the model
        self.run_cli("export", "hf", "--model", self.src, "--out", self.src)
        self.assertTrue(os.path.exists(os.path.join(self.src, "modeling_laplace.py")))

    def test_fp8_directory_loads_as_its_dequantized_values(self):
        """`laplace quantize`'s FP8 directory loads as code × row scale: the same float32 weights as the directory
        `laplace quantize --dequantize` writes, through the package and through an export."""
        q, d = os.path.join(self.tmp, "q"), os.path.join(self.tmp, "d")
        self.run_cli("quantize", "--model", self.src, "--out", q)
        self.run_cli("quantize", "--model", q, "--out", d, "--dequantize")
        name = "model.layers.0.wqkvg.weight"
        self.assertEqual(ml.read_safetensors_header(os.path.join(q, "model.safetensors"))[name][0], "F8_E4M3")
        mq = laplace.LaplaceForCausalLM.from_pretrained(q)
        md = laplace.LaplaceForCausalLM.from_pretrained(d)
        sq, sd = mq.state_dict(), md.state_dict()
        self.assertEqual(list(sq), list(sd))
        for n in sq:
            self.assertTrue(torch.equal(sq[n], sd[n]), n)
        orig = laplace.LaplaceForCausalLM.from_pretrained(self.src).state_dict()[name]
        self.assertFalse(torch.equal(sq[name], orig))  # rounded ...
        self.assertLess(float((sq[name] - orig).norm() / orig.norm()), 0.05)  # ... to E4M3's 3 mantissa bits
        hf = os.path.join(self.tmp, "hf_fp8")
        self.run_cli("export", "hf", "--model", q, "--out", hf)
        me = self.load_exported(hf).LaplaceForCausalLM.from_pretrained(hf)
        self.assertTrue(torch.equal(me.state_dict()[name], sq[name]))
        # a damaged scale or a NaN code: named, not turned into NaN weights
        with open(os.path.join(q, "model.safetensors"), "rb") as f:
            good = f.read()
        n = struct.unpack("<Q", good[:8])[0]
        info = json.loads(good[8:8 + n].decode("utf-8"))
        at_scale = 8 + n + info[name + "_scale"]["data_offsets"][0] + 4 * 2
        at_code = 8 + n + info[name]["data_offsets"][0] + 5
        for at, patch, want in ((at_scale, struct.pack("<f", float("nan")), r"weight_scale: row 2's scale is nan"),
                                (at_scale, struct.pack("<f", -1.0), r"row 2's scale is -1\.0"),
                                (at_code, b"\x7f", r"wqkvg\.weight: a NaN code at row 0, column 5")):
            with open(os.path.join(q, "model.safetensors"), "wb") as f:
                f.write(good[:at] + patch + good[at + len(patch):])
            with self.assertRaisesRegex(laplace.LaplaceCheckpointError, want):
                laplace.LaplaceForCausalLM.from_pretrained(q)
        with open(os.path.join(q, "model.safetensors"), "wb") as f:
            f.write(good)
        # scales missing: named, before any weight is read
        t = ml.read_safetensors_header(os.path.join(q, "model.safetensors"))
        self.assertIn(name + "_scale", t)
        with open(os.path.join(q, "model.safetensors"), "rb") as f:
            blob = f.read()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n].decode("utf-8"))
        header[name + "_scalX"] = header.pop(name + "_scale")  # same length: the offsets stay valid
        hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
        hj += b" " * (n - len(hj))
        with open(os.path.join(q, "model.safetensors"), "wb") as f:
            f.write(blob[:8] + hj + blob[8 + n:])
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError,
                                    r"tensor model\.layers\.0\.wqkvg\.weight is FP8 \(F8_E4M3\) but its scales, "
                                    r"model\.layers\.0\.wqkvg\.weight_scale, are missing"):
            laplace.LaplaceForCausalLM.from_pretrained(q)
        r = self.run_cli("export", "hf", "--model", q, "--out", os.path.join(self.tmp, "hf_bad"), ok=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("needs its scales model.layers.0.wqkvg.weight_scale", r.stdout)

    def test_export_errors(self):
        r = self.run_cli("export", "hf", "--model", os.path.join(self.tmp, "nope"), "--out", self.tmp, ok=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("does not exist", r.stdout)
        # a checkpoint without a tensor: named, and nothing written
        t = ml.read_safetensors(os.path.join(self.src, "model.safetensors"))
        t.pop("model.layers.1.onorm.weight")
        ml.write_safetensors(os.path.join(self.src, "model.safetensors"), t)
        out = os.path.join(self.tmp, "hf2")
        r = self.run_cli("export", "hf", "--model", self.src, "--out", out, ok=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("lacks tensor model.layers.1.onorm.weight", r.stdout)
        self.assertFalse(os.path.exists(out))
        with open(os.path.join(self.src, "config.json")) as f:
            c = json.load(f)
        c["model_type"] = "llama"
        with open(os.path.join(self.src, "config.json"), "w") as f:
            json.dump(c, f)
        r = self.run_cli("export", "hf", "--model", self.src, "--out", out, ok=False)
        self.assertIn("model_type", r.stdout)


class TestInstall(unittest.TestCase):
    def test_pip_install_offline(self):
        """`pip install ./python` with no network: setuptools from the system, no build isolation."""
        import importlib.util
        for mod in ("pip", "setuptools"):  # found, not imported (setuptools after torch upsets distutils)
            if importlib.util.find_spec(mod) is None:
                self.skipTest("%s is not installed" % mod)
        tmp = tempfile.mkdtemp(prefix="laplace_pip_")
        try:
            src = os.path.join(tmp, "src")
            os.makedirs(src)
            for f in ("pyproject.toml", "README_package.md"):
                shutil.copy(os.path.join(HERE, f), src)
            shutil.copytree(os.path.join(HERE, "laplace"), os.path.join(src, "laplace"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            target = os.path.join(tmp, "site")
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                "--no-index", "--disable-pip-version-check", "--target", target, src],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
            self.assertEqual(r.returncode, 0, r.stdout)
            code = "import laplace, sys; print(laplace.__version__, laplace.__file__); " \
                   "m = laplace.LaplaceForCausalLM(laplace.LaplaceConfig(**%r)); print(m.config.num_layers)" % TINY
            r = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=dict(os.environ, PYTHONPATH=target),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
            self.assertEqual(r.returncode, 0, r.stdout)
            self.assertIn(os.path.join(target, "laplace"), r.stdout)
            self.assertTrue(r.stdout.startswith("0.1.0 "), r.stdout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@unittest.skipUnless(HAVE_TRANSFORMERS, NO_TRANSFORMERS)
class TestTransformers(unittest.TestCase):
    """Runs where transformers is installed (the GPU machine, or a user's venv)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="laplace_hf_")
        self.ref, _, self.params = pair(30, big=False)
        self.dir = os.path.join(self.tmp, "m")
        write_model_dir(self.dir, TINY, self.params)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_auto_classes_and_generate(self):
        from transformers import AutoConfig, AutoModelForCausalLM
        self.assertIsInstance(AutoConfig.from_pretrained(self.dir), laplace.LaplaceConfig)
        model = AutoModelForCausalLM.from_pretrained(self.dir)
        self.assertIsInstance(model, laplace.LaplaceForCausalLM)
        prompt = [5, 17, 42, 3, 88, 1]
        want = lr.generate(self.ref, prompt, 20)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        self.assertEqual(out[0, len(prompt):].tolist(), want)

    def test_save_reload_and_remote_code(self):
        from transformers import AutoModelForCausalLM
        model = laplace.LaplaceForCausalLM.from_pretrained(self.dir)
        d = os.path.join(self.tmp, "saved")
        model.save_pretrained(d)
        back = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
        for (n, p), (n2, p2) in zip(model.state_dict().items(), back.state_dict().items()):
            self.assertEqual(n, n2)
            self.assertTrue(torch.equal(p, p2), n)

    def test_missing_tensor_through_transformers(self):
        del self.params["model.layers.0.conv.weight"]
        write_model_dir(self.dir, TINY, self.params)
        with self.assertRaisesRegex(laplace.LaplaceCheckpointError, r"model\.layers\.0\.conv\.weight"):
            laplace.LaplaceForCausalLM.from_pretrained(self.dir)


if __name__ == "__main__":
    unittest.main()
