"""Checkpoints by Hugging Face Hub id, through the real `huggingface_hub` client: against a local
endpoint (HF_ENDPOINT) that serves the real bytes of a tiny checkpoint as the Hub's HTTP API does
(repo info, tree listing, resolve with X-Repo-Commit and ETag; gated and missing repositories with
the Hub's X-Error-Code), then from the Hugging Face cache that download filled, with
HF_HUB_OFFLINE=1. The real Hub is never reached from here."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from klein_binary import KLEIN

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FAKE_HUB = {}  # "server": the running FakeHub server of the `hub` fixture


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's routes that `snapshot_download` uses, for the repositories of `self.server.repos`
    (`id -> folder`, or `"gated"`)."""

    def log_message(self, *args):
        pass

    def _send(self, status, body=b"", headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self._send(status, body, [("X-Error-Code", code), ("Content-Type", "application/json")])

    def _files(self, folder):
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?")[0]
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        folder = self.server.repos.get(repo_id)
        if folder is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if folder == "gated":
            return self._error(403, "GatedRepo", "Access to this model is restricted: accept its conditions")
        if len(rest) < 2 or rest[1] not in ("main", COMMIT):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        kind, file = rest[0], "/".join(rest[2:])
        if api and kind == "revision":
            info = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self._files(folder)]}
            return self._send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
        if api and kind == "tree":
            entries = [
                {
                    "type": "file",
                    "path": f,
                    "size": (folder / f).stat().st_size,
                    "oid": hashlib.sha1(f.encode()).hexdigest(),
                }
                for f in self._files(folder)
            ]
            return self._send(200, json.dumps(entries).encode(), [("Content-Type", "application/json")])
        if not api and kind == "resolve" and (folder / file).is_file():
            data = (folder / file).read_bytes()
            headers = [("X-Repo-Commit", COMMIT), ("ETag", f'"{hashlib.sha256(data).hexdigest()}"')]
            wanted = self.headers.get("Range", "").removeprefix("bytes=")
            if self.command == "GET" and wanted != "0-0":  # bytes sent, not a size asked
                self.server.sent.append(f"{repo_id}/{file}")
            if not wanted:
                return self._send(200, data, headers)
            # A byte range (hf-hub asks `bytes=0-0` for a file's size, then downloads by ranges).
            start, _, end = wanted.partition("-")
            start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
            headers.append(("Content-Range", f"bytes {start}-{end}/{len(data)}"))
            return self._send(206, data[start : end + 1], headers)
        return self._error(404, "EntryNotFound", f"{file} not found")


@pytest.fixture(scope="module")
def hub(tiny_checkpoint, tiny_bundle, tmp_path_factory):
    """A local Hub with `org/klein-tiny` (the tiny checkpoint, plus files an export never reads),
    `org/klein-tiny-bundle` (the tiny bundle), `org/tampered` (that bundle with one byte of a graph
    changed) and the gated `org/gated`; its URL."""
    served = tmp_path_factory.mktemp("hub") / "klein-tiny"
    shutil.copytree(tiny_checkpoint, served)
    (served / "README.md").write_text("a model card")
    (served / "flux-klein-tiny.safetensors").write_bytes(b"a single-file copy the export does not read")
    variant = served / "vae" / "diffusion_pytorch_model.fp16.safetensors"
    shutil.copy(next((served / "vae").glob("*.safetensors")), variant)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    tampered = tmp_path_factory.mktemp("hub") / "tampered"
    shutil.copytree(tiny_bundle, tampered)
    data = bytearray((tampered / "vae_decoder.onnx").read_bytes())
    data[-1] ^= 1
    (tampered / "vae_decoder.onnx").write_bytes(data)
    server.repos = {
        "org/klein-tiny": served,
        "org/klein-tiny-bundle": tiny_bundle,
        "org/tampered": tampered,
        "org/gated": "gated",
    }
    server.sent = []  # the files whose bytes were sent, by "repo/path"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FAKE_HUB["server"] = server
    yield f"http://127.0.0.1:{server.server_address[1]}", served
    server.shutdown()


def _run(code, cache, **env):
    environment = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    environment.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


RESOLVE = (
    "import sys; from klein_export.hub import resolve_checkpoint; from klein_export.checkpoint import Checkpoint; "
    "p = resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else 'org/klein-tiny'); Checkpoint(p); print(p)"
)


def test_hub_ids_download_only_what_the_export_reads_then_work_offline(hub, tiny_checkpoint, tmp_path):
    url, served = hub
    cache = tmp_path / "hf-cache"
    online = _run(RESOLVE, cache, HF_ENDPOINT=url)
    assert online.returncode == 0, online.stderr
    snapshot = Path(online.stdout.strip())
    assert snapshot.parent.name == "snapshots" and snapshot.name == COMMIT, snapshot
    assert (cache / "models--org--klein-tiny" / "refs" / "main").read_text() == COMMIT
    fetched = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    wanted = sorted(p.relative_to(tiny_checkpoint).as_posix() for p in Path(tiny_checkpoint).rglob("*") if p.is_file())
    read = ("model_index.json", "scheduler", "tokenizer", "text_encoder", "transformer", "vae")
    wanted = [f for f in wanted if f.split("/")[0] in read]
    assert fetched == wanted, (fetched, wanted)
    for name in fetched:  # the real bytes
        assert (snapshot / name).read_bytes() == (Path(tiny_checkpoint) / name).read_bytes(), name
    # The cache alone, the Hub unreachable by setting: the same snapshot.
    offline = _run(RESOLVE, cache, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip() == str(snapshot)


def test_gated_missing_and_uncached_repositories_say_what_to_do(hub, tmp_path):
    url, _ = hub
    cli = [sys.executable, "-m", "klein_export.cli", "convert", "--out", str(tmp_path / "out"), "--checkpoint"]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_ENDPOINT": url}
    env.pop("HF_TOKEN", None)
    gated = subprocess.run([*cli, "org/gated"], capture_output=True, text=True, env=env, timeout=300)
    assert gated.returncode == 2, gated.stderr
    page = "https://huggingface.co/org/gated"
    for needle in ("org/gated is a gated repository", f"accept its terms on {page}", "HF_TOKEN"):
        assert needle in gated.stderr, gated.stderr
    missing = subprocess.run([*cli, "org/nothing"], capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 2 and "no such model repository" in missing.stderr, missing.stderr
    revision = subprocess.run(
        [*cli, "org/klein-tiny", "--revision", "v9"], capture_output=True, text=True, env=env, timeout=300
    )
    assert revision.returncode == 2 and "no revision 'v9'" in revision.stderr, revision.stderr
    offline = subprocess.run(
        [*cli, "org/klein-tiny"], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300
    )
    assert offline.returncode == 2 and "is not in the Hugging Face cache" in offline.stderr, offline.stderr
    assert not (tmp_path / "out").exists()


def test_pull_installs_a_model_every_front_end_takes_by_name(hub, tmp_path, export_cache):
    """`klein-export pull ORG/NAME` downloads and converts into the models folder; then the CLI and
    the Python bindings take its name, and the CLI its Hub id, as the bundle's directory."""
    url, _ = hub
    models = tmp_path / "models"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_ENDPOINT": url}
    env["KLEIN_MODELS_DIR"] = str(models)
    env.pop("HF_TOKEN", None)
    pull = [sys.executable, "-m", "klein_export.cli", "pull", "org/klein-tiny", "--cache", str(export_cache)]
    run = subprocess.run(pull, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    installed = models / "klein-tiny"
    assert run.stdout.strip() == str(installed) and "klein generate --model klein-tiny" in run.stderr, run.stderr
    assert json.loads((installed / "manifest.json").read_text())["model"]["name"] == "klein-tiny"

    def generate(model, out):
        args = [str(KLEIN), "generate", "--model", model, "-q", "-o", str(out), "--width", "64", "--height", "64"]
        return subprocess.run([*args, "--seed", "3", "x"], capture_output=True, text=True, env=env, cwd=tmp_path)

    outputs = []
    for i, model in enumerate(["klein-tiny", "org/klein-tiny", str(installed)]):
        done = generate(model, tmp_path / f"{i}.png")
        assert done.returncode == 0, done.stderr
        outputs.append((tmp_path / f"{i}.png").read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]
    listed = subprocess.run([str(KLEIN), "models"], capture_output=True, text=True, env=env)
    assert listed.returncode == 0 and "klein-tiny" in listed.stdout and str(installed) in listed.stdout, listed
    code = "import klein_runtime as k; p = k.Pipeline(model='klein-tiny'); print(p.model_name, p.bundle_dir)"
    bindings = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bindings.returncode == 0 and bindings.stdout.split() == ["klein-tiny", str(installed)], bindings.stderr

    # A name nothing has: exit 2, naming what is installed and how to get more.
    unknown = generate("klein-other", tmp_path / "x.png")
    assert unknown.returncode == 2, unknown.stderr
    for needle in ("klein-other", "not an installed model", "klein-tiny", "klein-export pull"):
        assert needle in unknown.stderr, unknown.stderr
    # Pulled again: refused without --force, which replaces it.
    again = subprocess.run(pull, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert subprocess.run([*pull, "--force"], capture_output=True, text=True, env=env, timeout=600).returncode == 0


def test_pull_of_a_bundle_repository_checks_every_file_against_its_manifest(hub, tiny_bundle, tmp_path):
    url, _ = hub
    models = tmp_path / "models"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_ENDPOINT": url}
    env["KLEIN_MODELS_DIR"] = str(models)
    env.pop("HF_TOKEN", None)
    pull = [sys.executable, "-m", "klein_export.cli", "pull"]
    run = subprocess.run([*pull, "org/klein-tiny-bundle"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "every file matches its manifest's sha256" in run.stderr, run.stderr
    installed = models / "klein-tiny-bundle"
    want = {p.name: p.read_bytes() for p in Path(tiny_bundle).iterdir()}
    assert {p.name: p.read_bytes() for p in installed.iterdir()} == want
    assert not any(p.is_symlink() for p in installed.iterdir())
    args = [str(KLEIN), "generate", "--model", "org/klein-tiny-bundle", "-q", "-o", str(tmp_path / "a.png")]
    done = subprocess.run([*args, "--width", "32", "--height", "32", "x"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    # One byte changed in the repository: refused, naming the file, and nothing installed.
    bad = subprocess.run([*pull, "org/tampered"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert "vae_decoder.onnx does not match the manifest" in bad.stderr and "nothing was installed" in bad.stderr
    assert not (models / "tampered").exists()


def test_the_runtime_fetches_a_bundle_repository_by_id_and_checks_it(hub, tiny_bundle, tmp_path):
    """`--model ORG/NAME` of a bundle repository not installed: the runtime itself (hf-hub) fetches
    it into the Hugging Face cache, checks every file against the manifest, installs it, and gives
    the bundle's own pixels; then the installed copy and the cache serve without the Hub."""
    url, _ = hub
    models = tmp_path / "models"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_ENDPOINT": url}
    env["KLEIN_MODELS_DIR"] = str(models)
    env.pop("HF_TOKEN", None)
    env.pop("HF_HUB_OFFLINE", None)

    def generate(model, out, **extra):
        args = [str(KLEIN), "generate", "--model", model, "-q", "-o", str(out), "--width", "32", "--height", "32"]
        run_env = {**env, **extra}
        return subprocess.run([*args, "--seed", "5", "x"], capture_output=True, text=True, env=run_env, timeout=300)

    want = generate(str(tiny_bundle), tmp_path / "want.png")
    assert want.returncode == 0, want.stderr
    fetched = generate("org/klein-tiny-bundle", tmp_path / "hub.png")
    assert fetched.returncode == 0, fetched.stderr
    assert "fetching org/klein-tiny-bundle from the Hugging Face Hub" in fetched.stderr, fetched.stderr
    assert "org/klein-tiny-bundle/transformer.onnx" in FAKE_HUB["server"].sent
    assert (tmp_path / "hub.png").read_bytes() == (tmp_path / "want.png").read_bytes()
    installed = models / "klein-tiny-bundle"
    assert {p.name: p.read_bytes() for p in installed.iterdir()} == {
        p.name: p.read_bytes() for p in Path(tiny_bundle).iterdir()
    }
    assert not any(p.is_symlink() for p in installed.iterdir())
    # Installed: no Hub needed (an endpoint where nothing listens).
    again = generate("org/klein-tiny-bundle", tmp_path / "again.png", HF_ENDPOINT="http://127.0.0.1:9")
    assert again.returncode == 0 and "fetching" not in again.stderr, again.stderr
    # Online into another models folder: the Hub's commit is the cached one, so no file is sent again.
    server = FAKE_HUB["server"]
    sent = len(server.sent)
    cached = generate("org/klein-tiny-bundle", tmp_path / "cached.png", KLEIN_MODELS_DIR=str(tmp_path / "m1"))
    assert cached.returncode == 0 and "fetching" in cached.stderr, cached.stderr
    assert server.sent[sent:] == [], server.sent[sent:]
    # HF_HUB_OFFLINE: from the cache that first download filled, into another models folder...
    offline = generate(
        "org/klein-tiny-bundle", tmp_path / "offline.png", HF_HUB_OFFLINE="1", KLEIN_MODELS_DIR=str(tmp_path / "m2")
    )
    assert offline.returncode == 0, offline.stderr
    assert (tmp_path / "offline.png").read_bytes() == (tmp_path / "want.png").read_bytes()
    # ...and with an empty cache, an error that says what to do.
    empty = generate(
        "org/klein-tiny-bundle",
        tmp_path / "x.png",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp_path / "empty"),
        KLEIN_MODELS_DIR=str(tmp_path / "m3"),
    )
    assert empty.returncode == 2 and "HF_HUB_OFFLINE is set" in empty.stderr, empty.stderr
    # Refusals, each with exit 2 and nothing installed or written.
    refusals = {
        "org/tampered": ["vae_decoder.onnx does not match the manifest", "nothing was installed"],
        "org/gated": ["a gated repository", "accept its terms on https://huggingface.co/org/gated", "HF_TOKEN"],
        "org/klein-tiny": ["holds a diffusers checkpoint", "`klein-export pull org/klein-tiny`"],
        "org/nothing": ["no such model repository on the Hub"],
    }
    for model, needles in refusals.items():
        out = tmp_path / "refused.png"
        refused = generate(model, out)
        assert refused.returncode == 2, (model, refused.stderr)
        for needle in needles:
            assert needle in refused.stderr, (model, refused.stderr)
        assert "panicked" not in refused.stderr and not out.exists(), refused.stderr
    assert sorted(p.name for p in models.iterdir()) == ["klein-tiny-bundle"]
    # The Python bindings fetch the same way (their own models folder, the cache already filled).
    code = "import klein_runtime as k; p = k.Pipeline(model='org/klein-tiny-bundle'); print(p.bundle_dir)"
    bindings = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "KLEIN_MODELS_DIR": str(tmp_path / "m4")},
    )
    assert bindings.returncode == 0, bindings.stderr
    assert bindings.stdout.strip() == str(tmp_path / "m4" / "klein-tiny-bundle"), bindings.stdout
