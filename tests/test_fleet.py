#!/usr/bin/python3
"""A fleet of `laplace serve` replicas behind the real HAProxy, on 127.0.0.1.

scripts/serve_fleet.sh starts 3 CPU replicas of a small random-weight model (a 400-piece
tokenizer and laplace-tiny's shapes, as tests/serve_fixture.sh makes it) with a shared
--session-dir and HAProxy (deploy/haproxy.cfg.in) in front; the tests go through the front door:

  health     each replica's /health (no key) names it and the fleet's model_hash; /metrics has
             laplace_replica_info
  affinity   a session's requests (X-Laplace-Affinity header, /v1/sessions/NAME paths, the body's
             `session` / `save_session` / POST /v1/sessions `name`) all reach one replica, whose
             state cache then hits (cached_tokens > 0)
  spread     100 anonymous streamed completions reach all three replicas, none more than half
  client     the official `openai` npm package (tests/openai_client/test.mjs) through the front
             door (skipped with a message where node or its node_modules is missing)
  edge       an invalid session name through the front door gets the replica's 400
  drain      SIGTERM to a replica with a live stream: the stream completes ([DONE], a
             finish_reason); no later request reaches that replica and no client sees a 503,
             also requests whose affinity key maps to it
  failover   kill -9 of the replica serving a saved session, mid-stream: that stream fails, the
             next request continuing the session succeeds on another replica, which loads it from
             the shared --session-dir (the same greedy continuation as before the kill; its
             context is the saved one)
  mixed      replicas of two different models: serve_fleet.sh refuses, naming the replicas, and
             leaves nothing running; and HAProxy with a config rendered for one model's hash
             (serve_fleet.sh render) keeps a replica of the other DOWN (its /health body does not
             match) and sends it nothing

Usage: /usr/bin/python3 tests/test_fleet.py LAPLACE_BINARY [unittest args]
Exits 77 (ctest: skipped) when haproxy or curl is not installed.
"""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLEET = os.path.join(ROOT, "scripts", "serve_fleet.sh")
LAPLACE = None  # set from argv in main
KEY = "fleet-test-key"
MODEL = "tiny"
REPLICAS = 3


def make_model_dir(work, seed=5, name="model"):
    """Like tests/serve_fixture.sh's make_model_dir (VOCAB=400): a tokenizer trained on a
    repetitive text, laplace-tiny's shapes, random weights."""
    corpus = os.path.join(work, "corpus.txt")
    if not os.path.exists(corpus):
        with open(corpus, "w") as f:
            for i in range(1, 301):
                f.write("the quick brown fox %d jumps over the lazy dog; a fortune a day keeps the doctor away.\n" % i)
                f.write("Why did the programmer quit? Because he did not get arrays. The meaning of life is %d.\n" % (i % 7))
        subprocess.run([LAPLACE, "tokenizer", "train", "--input", corpus, "--model-prefix", os.path.join(work, "tok"),
                        "--vocab-size", "400"], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(ROOT, "configs", "laplace-tiny.json")) as f:
            cfg = re.sub(r'"vocab_size": [0-9]*', '"vocab_size": 400', f.read())
        with open(os.path.join(work, "config.json"), "w") as f:
            f.write(cfg)
    out = os.path.join(work, name)
    subprocess.run([LAPLACE, "init", "--config", os.path.join(work, "config.json"), "--out", out, "--seed", str(seed)],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.copy(os.path.join(work, "tok.model"), os.path.join(out, "tokenizer.model"))
    return out


def fleet_env():
    env = dict(os.environ, LAPLACE=LAPLACE, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
               PATH=os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin")
    env.pop("CUDA_VISIBLE_DEVICES", None)  # CPU replicas (serve_fleet.sh would take GPUs from it)
    return env


def read_env(path):
    out = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("=")
            out[k] = v.replace("\\ ", " ")
    return out


def pid_of(rundir, replica):
    with open(os.path.join(rundir, replica + ".pid")) as f:
        return int(f.read().split()[0])


def process_alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Front:
    """Requests to the front door, one connection each (as independent clients)."""

    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port

    def request(self, method, path, body=None, headers=None, timeout=60):
        """(status, headers dict with lower-case names, parsed JSON or raw text)."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        h = {"Authorization": "Bearer " + KEY}
        if body is not None:
            h["Content-Type"] = "application/json"
            body = json.dumps(body) if not isinstance(body, (str, bytes)) else body
        h.update(headers or {})
        try:
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            data = r.read().decode("utf-8", "replace")
            hdrs = {k.lower(): v for k, v in r.getheaders()}
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = data
            return r.status, hdrs, parsed
        finally:
            c.close()

    def post(self, path, body, headers=None, timeout=60):
        return self.request("POST", path, body, headers, timeout)

    def open_stream(self, body, headers=None, timeout=120):
        """Starts a streamed completion; returns (connection, response). Read with read_events."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        h = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
        h.update(headers or {})
        c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)), headers=h)
        return c, c.getresponse()


def read_events(resp, on_event=None):
    """Reads an SSE stream to its end: (events as parsed JSON, saw [DONE], error or None)."""
    events, done = [], False
    try:
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if on_event:
                on_event(ev)
    except (http.client.HTTPException, OSError, ValueError) as e:
        return events, done, e
    return events, done, None


def finish_reason(events):
    for ev in events:
        for c in ev.get("choices", []):
            if c.get("finish_reason"):
                return c["finish_reason"]
    return None


class FleetTest(unittest.TestCase):
    """One fleet of 3 replicas for all tests; they run in name order (the last two take
    replicas away)."""

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="laplace-fleet-")
        cls.addClassCleanup(shutil.rmtree, cls.work, ignore_errors=True)
        cls.model = make_model_dir(cls.work)
        cls.rundir = os.path.join(cls.work, "fleet")
        cls.addClassCleanup(cls.stop_fleet)
        t0 = time.time()
        r = subprocess.run(
            ["bash", FLEET, "start", str(REPLICAS), "--model", cls.model, "--port", "0", "--dir", cls.rundir, "--cpu",
             "--ready-timeout", "60", "--", "--name", MODEL, "--api-key", KEY, "--max-slots", "4", "--threads", "2",
             "--max-tokens", "1000000", "--grace-seconds", "60"],
            env=fleet_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError("serve_fleet.sh start failed (%d):\n%s%s" % (r.returncode, r.stdout, r.stderr))
        cls.url = r.stdout.strip().splitlines()[-1]
        print("fleet up in %.1f s: %s" % (time.time() - t0, cls.url), file=sys.stderr)
        cls.env = read_env(os.path.join(cls.rundir, "fleet.env"))
        cls.front = Front(cls.url)

    @classmethod
    def stop_fleet(cls):
        subprocess.run(["bash", FLEET, "stop", "--dir", cls.rundir, "--timeout", "10"], env=fleet_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    def replica_of(self, headers):
        r = headers.get("x-laplace-replica")
        self.assertIsNotNone(r, "no X-Laplace-Replica header in %s" % headers)
        return r

    def complete(self, body, headers=None):
        status, h, out = self.front.post("/v1/completions", body, headers)
        self.assertEqual(status, 200, out)
        return self.replica_of(h), out

    def keys_by_replica(self, n=40):
        """Affinity keys k0..k{n-1} grouped by the replica each maps to now."""
        out = {}
        for i in range(n):
            status, h, _ = self.front.request("GET", "/v1/models", headers={"X-Laplace-Affinity": "key-%d" % i})
            self.assertEqual(status, 200)
            out.setdefault(self.replica_of(h), []).append("key-%d" % i)
        return out

    # ---- tests, in order ----------------------------------------------------------------------

    def test_1_health_and_metrics_name_the_replica(self):
        """Every replica reports the fleet's model_hash (what HAProxy's check matches)."""
        for i in range(REPLICAS):
            u = urllib.parse.urlparse(self.env["URL_r%d" % i])
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            c.request("GET", "/health")  # no key: what HAProxy's check sends
            r = c.getresponse()
            h = json.loads(r.read())
            self.assertEqual(r.status, 200)
            self.assertEqual(h["replica"], "r%d" % i)
            self.assertEqual(h["model_hash"], self.env["MODEL_HASH"])
            self.assertEqual(h["status"], "ok")
            c.request("GET", "/metrics", headers={"Authorization": "Bearer " + KEY})
            m = c.getresponse().read().decode()
            self.assertIn('laplace_replica_info{replica="r%d",model="%s",model_hash="%s"} 1' % (i, MODEL, h["model_hash"]), m)
            c.close()

    def test_2_affinity(self):
        # The header: each key always reaches one replica, and its repeated prompt is a cache hit there.
        seen = {}
        for i in range(9):
            key = "conversation-%d" % i
            prompt = "Why did the programmer quit? Conversation %d." % i
            where = set()
            for turn in range(3):
                r, out = self.complete({"prompt": prompt, "max_tokens": 2, "temperature": 0},
                                       {"X-Laplace-Affinity": key})
                where.add(r)
                cached = out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                if turn > 0:
                    self.assertGreater(cached, 0, "turn %d of %s (on %s) missed the state cache: %s" % (turn, key, r, out))
            self.assertEqual(len(where), 1, "%s reached %s" % (key, where))
            seen[key] = where.pop()
        self.assertGreater(len(set(seen.values())), 1, "9 keys all on one replica: %s" % seen)

        # A session: created (body `name`), read and saved (path), continued (body `session`) and
        # kept under another name (`save_session`), then that one continued: one replica per name.
        # Until it is saved, a GET on another replica would be a 404 (the session is in one
        # replica's memory only).
        for i in range(4):
            name = "affinity-session-%d" % i
            status, h, out = self.front.post("/v1/sessions", {"name": name, "prompt": "the quick brown fox %d" % i})
            self.assertEqual(status, 200, out)
            home = self.replica_of(h)
            status, h, out = self.front.request("GET", "/v1/sessions/" + name)
            self.assertEqual((status, self.replica_of(h)), (200, home), out)
            tokens = out["tokens"]
            r, out = self.complete({"session": name, "prompt": " jumps", "max_tokens": 2, "temperature": 0})
            self.assertEqual(r, home)
            self.assertGreater(out["usage"]["prompt_tokens_details"]["cached_tokens"], 0, out)
            status, h, out = self.front.post("/v1/sessions/%s/save" % name, {})
            self.assertEqual((status, self.replica_of(h)), (200, home), out)
            # The header names the session too (as the web page sends it).
            status, h, out = self.front.request("GET", "/v1/sessions/" + name, headers={"X-Laplace-Affinity": name})
            self.assertEqual((status, self.replica_of(h), out.get("tokens")), (200, home, tokens), out)
            # `session` is looked at before `save_session`: the copy is kept on the session's
            # replica, and the header (which comes first) reaches it there.
            kept = name + "-copy"
            r, _ = self.complete({"session": name, "prompt": " over", "max_tokens": 2, "save_session": kept})
            self.assertEqual(r, home)
            r, _ = self.complete({"session": kept, "prompt": " the", "max_tokens": 1}, {"X-Laplace-Affinity": name})
            self.assertEqual(r, home)
            # `save_session` alone: the session is kept on its own name's replica, where the
            # next request naming it goes.
            r1, _ = self.complete({"save_session": name + "-new", "prompt": "a fortune", "max_tokens": 1})
            r2, _ = self.complete({"session": name + "-new", "prompt": " a day", "max_tokens": 1})
            self.assertEqual(r1, r2)

        # Nothing else in the request: the path alone (DELETE with a query string).
        status, h, _ = self.front.request("DELETE", "/v1/sessions/affinity-session-0?file=true")
        self.assertEqual(status, 200)
        status, h, out = self.front.request("GET", "/v1/sessions/affinity-session-0")
        self.assertEqual(status, 404, out)  # gone from its replica's memory and from the directory

    def test_3_spread(self):
        counts, lock, errors = {}, threading.Lock(), []

        def one(i):
            try:
                c, resp = self.front.open_stream({"prompt": "The meaning of life is %d" % i, "max_tokens": 4})
                r = resp.getheader("X-Laplace-Replica")
                events, done, err = read_events(resp)
                c.close()
                if resp.status != 200 or not done or err or finish_reason(events) is None:
                    errors.append((i, resp.status, done, err))
                with lock:
                    counts[r] = counts.get(r, 0) + 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append((i, e))

        threads = []
        for i in range(100):
            t = threading.Thread(target=one, args=(i,))
            threads.append(t)
            t.start()
            if len(threads) % 4 == 0:  # four at a time
                for t in threads[-4:]:
                    t.join()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(sum(counts.values()), 100)
        self.assertEqual(sorted(counts), ["r0", "r1", "r2"], counts)
        self.assertLessEqual(max(counts.values()), 50, counts)
        print("spread: %s" % counts, file=sys.stderr)

    def test_4_openai_client(self):
        node = shutil.which("node")
        mods = os.path.join(HERE, "openai_client", "node_modules", "openai")
        if not node or not os.path.isdir(mods):
            self.skipTest("node or tests/openai_client/node_modules is missing "
                          "(LAPLACE_SETUP_NODE=1 scripts/setup.sh installs them)")
        env = dict(os.environ, LAPLACE_URL=self.url, LAPLACE_MODEL=MODEL, LAPLACE_API_KEY=KEY)
        r = subprocess.run([node, "--test", os.path.join(HERE, "openai_client", "test.mjs")], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout[-4000:])

    def test_5_bad_input_at_the_edge(self):
        """Invalid session names reach a replica (HAProxy hashes whatever key it finds) and get its 400."""
        cases = [
            ("GET", "/v1/sessions/.hidden", None),
            ("POST", "/v1/sessions/bad%20name/save", {}),
            ("POST", "/v1/sessions", {"name": "no/slashes", "prompt": "x"}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "session": "../../etc/passwd"}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "save_session": "x" * 65}),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "session": 5}),
            ("POST", "/v1/completions", '{"prompt": "x", "session": '),  # not JSON: no key, still the replica's 400
        ]
        for method, path, body in cases:
            status, h, out = self.front.request(method, path, body)
            self.assertEqual(status, 400, (method, path, body, out))
            self.assertIn(self.replica_of(h), ("r0", "r1", "r2"))
            self.assertIsInstance(out, dict, out)
            self.assertIn("error", out)
            self.assertEqual(out["error"]["type"], "invalid_request_error", out)

    def test_6_drain(self):
        keys = self.keys_by_replica()
        # A stream of about 8 s (the replicas' --grace-seconds is 60), its length from the rate
        # of a short one just before (on 2 shared cores it varies tenfold); whichever replica it
        # reaches is the one stopped.
        t0 = time.time()
        c, resp = self.front.open_stream({"prompt": "The quick", "max_tokens": 256, "ignore_eos": True})
        self.assertTrue(read_events(resp)[1])
        c.close()
        n = int(min(60000, max(600, 256 / (time.time() - t0) * 8)))
        c, resp = self.front.open_stream({"prompt": "The quick", "max_tokens": n, "ignore_eos": True,
                                          "stream_options": {"include_usage": True}})
        self.addCleanup(c.close)
        self.assertEqual(resp.status, 200)
        victim = resp.getheader("X-Laplace-Replica")
        first = threading.Event()
        result = {}

        def reader():
            result["events"], result["done"], result["err"] = read_events(resp, lambda ev: first.set())
            result["end"] = time.time()

        t = threading.Thread(target=reader)
        t.start()
        self.assertTrue(first.wait(30), "no first token")
        pid = pid_of(self.rundir, victim)
        os.kill(pid, signal.SIGTERM)
        stopped_at = time.time()
        # "After the SIGTERM" = once the replica has taken it: its own /health says 503.
        u = urllib.parse.urlparse(self.env["URL_" + victim])
        for _ in range(500):
            hc = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
            hc.request("GET", "/health")
            hr = hc.getresponse()
            health = hr.read()
            hc.close()
            if hr.status == 503:
                break
            time.sleep(0.01)
        self.assertEqual(hr.status, 503, health)
        self.assertEqual(json.loads(health)["status"], "stopping")
        # Right away (before HAProxy's next check sees that 503), and for a while after:
        # requests whose key maps to the victim, and anonymous ones.
        seen, statuses = [], []
        victim_keys = keys.get(victim, [])
        self.assertTrue(victim_keys, "no key maps to %s: %s" % (victim, keys))
        log_from = os.path.getsize(os.path.join(self.rundir, "haproxy.log"))
        deadline = time.time() + 2
        i = 0
        while time.time() < deadline and i < 100:
            for body, hdr in (({"prompt": "a fortune", "max_tokens": 1}, {"X-Laplace-Affinity": victim_keys[i % len(victim_keys)]}),
                              ({"prompt": "a day", "max_tokens": 1}, None)):
                status, h, out = self.front.post("/v1/completions", body, hdr)
                statuses.append(status)
                seen.append(h.get("x-laplace-replica"))
            i += 1
            time.sleep(0.02)
        stream_live_after = result.get("end") is None
        t.join(60)
        self.assertFalse(t.is_alive(), "the stream did not end")
        self.assertEqual(set(statuses), {200}, statuses)
        self.assertNotIn(victim, seen, "a request after the SIGTERM reached %s: %s" %
                         (victim, {r: seen.count(r) for r in set(seen)}))
        self.assertIsNone(result["err"], result["err"])
        self.assertTrue(result["done"], "the stream did not end with [DONE]")
        self.assertEqual(finish_reason(result["events"]), "length", result["events"][-3:])
        self.assertFalse(any("error" in ev for ev in result["events"]), "an error event in the stream")
        usage = [ev["usage"] for ev in result["events"] if ev.get("usage")]
        self.assertEqual(usage[-1]["completion_tokens"] if usage else None, n)
        self.assertTrue(stream_live_after, "the stream ended before the requests after the SIGTERM: lengthen it")
        c.close()
        # The stream done, the victim exits (its grace is 60 s); the fleet answers without it.
        for _ in range(100):
            if not process_alive(pid):
                break
            time.sleep(0.1)
        self.assertFalse(process_alive(pid), "%s still runs 10 s after its stream ended" % victim)
        for k in victim_keys[:5]:
            r, _ = self.complete({"prompt": "keeps the doctor away", "max_tokens": 1}, {"X-Laplace-Affinity": k})
            self.assertNotEqual(r, victim)
        # HAProxy's log: requests it sent to the victim first and then to another replica (their
        # retry counter is "+N": redispatched), answered 200 there.
        with open(os.path.join(self.rundir, "haproxy.log")) as f:
            f.seek(log_from)
            redispatched = len(re.findall(r" 200 .* [0-9]+/[0-9]+/[0-9]+/[0-9]+/\+[1-9]", f.read()))
        print("drain: %s's stream ended %.1f s after its SIGTERM; %d requests meanwhile, all 200, on %s; "
              "%d redispatched by HAProxy" % (victim, result["end"] - stopped_at, len(statuses), sorted(set(seen)),
                                              redispatched), file=sys.stderr)
        FleetTest.drained = victim

    def test_7_failover(self):
        name = "failover-session"
        status, h, out = self.front.post("/v1/sessions", {"name": name, "prompt": "The meaning of life is"})
        self.assertEqual(status, 200, out)
        home = self.replica_of(h)
        status, h, out = self.front.post("/v1/sessions/%s/save" % name, {})
        self.assertEqual((status, self.replica_of(h)), (200, home), out)
        self.assertTrue(os.path.exists(os.path.join(self.rundir, "sessions", name + ".session")))
        status, h, saved = self.front.request("GET", "/v1/sessions/" + name)
        self.assertEqual(status, 200, saved)
        saved_ids = saved["token_ids"]
        # A greedy continuation of the saved context, on its replica (a request naming a session
        # without save_session leaves it as it was).
        probe = {"session": name, "prompt": " over the", "max_tokens": 6, "temperature": 0}
        r, before = self.complete(probe)
        self.assertEqual(r, home)

        # A long stream continuing the session, on its replica; kill -9 that replica mid-stream.
        c, resp = self.front.open_stream({"session": name, "prompt": " the quick", "max_tokens": 100000,
                                          "ignore_eos": True})
        self.addCleanup(c.close)
        self.assertEqual(resp.status, 200)
        self.assertEqual(resp.getheader("X-Laplace-Replica"), home)
        got = threading.Event()
        result = {}

        def reader():
            result["events"], result["done"], result["err"] = read_events(resp, lambda ev: got.set())

        t = threading.Thread(target=reader)
        t.start()
        self.assertTrue(got.wait(30), "no first token")
        time.sleep(0.3)
        pid = pid_of(self.rundir, home)
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        self.assertFalse(t.is_alive(), "the stream did not end when its replica was killed")
        c.close()
        self.assertFalse(result["done"] and result["err"] is None and finish_reason(result["events"]),
                         "the stream of a killed replica completed normally")

        # The next request continuing the session: another replica, from the saved file — the
        # same greedy continuation as on the replica that is gone.
        other, after = self.complete(probe)
        self.assertNotEqual(other, home)
        self.assertEqual(after["choices"][0]["text"], before["choices"][0]["text"])
        self.assertEqual(after["usage"]["prompt_tokens"], before["usage"]["prompt_tokens"])
        # Continued and kept: the session now lives on that replica.
        r, out = self.complete({"session": name, "save_session": name, "prompt": " over", "max_tokens": 3,
                                "temperature": 0})
        self.assertEqual(r, other)
        status, h, now = self.front.request("GET", "/v1/sessions/" + name)
        self.assertEqual((status, self.replica_of(h)), (200, other), now)
        # The saved context, then this request's prompt and completion: nothing of the killed stream.
        self.assertEqual(now["token_ids"][:len(saved_ids)], saved_ids)
        self.assertLessEqual(len(now["token_ids"]), len(saved_ids) + 10, now)
        self.assertGreater(len(now["token_ids"]), len(saved_ids))
        print("failover: %s killed, session %s continued on %s" % (home, name, other), file=sys.stderr)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MixedModelsTest(unittest.TestCase):
    """Two models (laplace-tiny's shapes, seeds 5 and 6): never one fleet."""

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="laplace-fleet-mixed-")
        cls.addClassCleanup(shutil.rmtree, cls.work, ignore_errors=True)
        cls.a = make_model_dir(cls.work, seed=5, name="a")
        cls.b = make_model_dir(cls.work, seed=6, name="b")

    def serve(self, model, replica):
        """`laplace serve` of MODEL on a free port, ready; returns its port."""
        log = os.path.join(self.work, replica + ".log")
        with open(log, "w") as out:
            p = subprocess.Popen([LAPLACE, "serve", "--model", model, "--name", MODEL, "--port", "0", "--replica-id",
                                  replica, "--max-slots", "1", "--threads", "1"], stdout=out, stderr=subprocess.STDOUT,
                                 env=fleet_env())
        self.addCleanup(p.wait)
        self.addCleanup(p.terminate)
        for _ in range(600):
            with open(log) as f:
                text = f.read()
            if "ready" in text:
                return int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", text).group(1))
            self.assertIsNone(p.poll(), text)
            time.sleep(0.05)
        self.fail("%s not ready: %s" % (replica, text))

    def test_haproxy_check_keeps_another_model_out(self):
        """The rendered config's health check matches the fleet's model_hash: a replica of
        another model (here: started by hand beside the fleet's) is DOWN and gets nothing."""
        pa, pb = self.serve(self.a, "ra"), self.serve(self.b, "rb")
        servers = ["--server", "ra=127.0.0.1:%d" % pa, "--server", "rb=127.0.0.1:%d" % pb]
        r = subprocess.run(["bash", FLEET, "render"] + servers, env=fleet_env(), capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("different models", r.stderr)
        c = http.client.HTTPConnection("127.0.0.1", pa, timeout=10)
        c.request("GET", "/health")
        hash_a = json.loads(c.getresponse().read())["model_hash"]
        c.close()
        front, stats = free_port(), free_port()
        r = subprocess.run(["bash", FLEET, "render", "--hash", hash_a, "--port", str(front), "--stats-port", str(stats)]
                           + servers, env=fleet_env(), capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        cfg = os.path.join(self.work, "haproxy.cfg")
        with open(cfg, "w") as f:
            f.write(r.stdout)
        with open(os.path.join(self.work, "haproxy.log"), "w") as out:
            hap = subprocess.Popen([shutil.which("haproxy", path=fleet_env()["PATH"]), "-f", cfg, "-db"], stdout=out,
                                   stderr=subprocess.STDOUT)
        self.addCleanup(hap.wait)
        self.addCleanup(hap.kill)
        state = {}
        for _ in range(100):
            try:
                c = http.client.HTTPConnection("127.0.0.1", stats, timeout=5)
                c.request("GET", "/stats;csv")
                rows = [ln.split(",") for ln in c.getresponse().read().decode().splitlines()]
                c.close()
                state = {row[1]: (row[17], row[36]) for row in rows if row[0] == "laplace" and row[1] in ("ra", "rb")}
                if state.get("ra", ("",))[0] == "UP" and state.get("rb", ("",))[0].startswith("DOWN"):
                    break
            except OSError:
                pass
            time.sleep(0.1)
        self.assertEqual(state["ra"][0], "UP", state)
        self.assertEqual(state["rb"], ("DOWN", "L7RSP"), state)  # answered 200, but the body did not match
        front_door = Front("http://127.0.0.1:%d" % front)
        for i in range(12):
            status, h, _ = front_door.request("GET", "/v1/models", headers={"X-Laplace-Affinity": "k%d" % i} if i % 2 else None)
            self.assertEqual((status, h.get("x-laplace-replica")), (200, "ra"))

    def test_refused(self):
        work, a, b = self.work, self.a, self.b
        rundir = os.path.join(work, "fleet")
        self.addCleanup(subprocess.run, ["bash", FLEET, "stop", "--dir", rundir, "--timeout", "5"], env=fleet_env(),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = subprocess.run(["bash", FLEET, "start", "2", "--model", a, "--model", b, "--port", "0", "--dir", rundir,
                            "--cpu", "--", "--name", MODEL, "--max-slots", "1", "--threads", "1"],
                           env=fleet_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertIn("refusing to start: the replicas serve different models", r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("  r")]
        self.assertEqual(len(lines), 2, r.stderr)
        self.assertIn("r0 (", lines[0])
        self.assertIn("--model " + a, lines[0])
        self.assertIn("r1 (", lines[1])
        self.assertIn("--model " + b, lines[1])
        hashes = [ln.split("model_hash ")[1] for ln in lines]
        self.assertNotEqual(hashes[0], hashes[1])
        # Nothing left running: no haproxy, no replica answers on its port.
        self.assertFalse(os.path.exists(os.path.join(rundir, "haproxy.pid")))
        self.assertEqual([f for f in os.listdir(rundir) if f.endswith(".pid")], [])
        for port in re.findall(r"ready on http://127\.0\.0\.1:(\d+)", r.stderr):
            c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=2)
            with self.assertRaises(OSError):
                c.request("GET", "/health")
                c.getresponse()


def main():
    global LAPLACE
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print("usage: test_fleet.py LAPLACE_BINARY [unittest args]", file=sys.stderr)
        return 2
    LAPLACE = os.path.abspath(sys.argv[1])
    for tool in ("haproxy", "curl"):
        if not shutil.which(tool) and not os.path.exists("/usr/sbin/" + tool):
            print("SKIP: %s is not installed (apt-get install %s)" % (tool, tool), file=sys.stderr)
            return 77
    prog = unittest.main(argv=[sys.argv[0]] + sys.argv[2:], exit=False, verbosity=2)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
