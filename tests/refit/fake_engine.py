"""A fake engine for refit tests: vLLM's RL endpoints over a plain state dict, in its own process.

It exists so a test can have a second engine (this machine runs one real vLLM server at a time) and
kill it mid-refit. It speaks the same HTTP endpoints and the same refit_gloo wire protocol (header,
then bucket, planned by refit._buckets, received and checked by refit._transport; or a delta stream,
refit._delta) as refit.vllm_worker, and stores what it receives once the whole stream has arrived.
Run: python fake_engine.py MODEL_DIR PORT
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

from safetensors import safe_open

from refit._buckets import ParamSpec, bucket_nbytes, plan_buckets, unpack_bucket
from refit._delta import DeltaIncoming, bucket_unit
from refit._transport import Incoming, ReceiveBuffers, VerifyError, join_gloo_group

STATE = {"version": "0", "paused": False, "group": None, "weights": {}, "pending_token": None}
VERIFY = {"checked": 0, "failed": None, "error": ""}
BUFFERS = ReceiveBuffers()  # kept between refits, as the vLLM worker keeps its own
LOCK = threading.Lock()


def checkpoint_specs(model_dir: Path) -> list[list]:
    specs = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118
                specs.append([name, list(reader.get_slice(name).get_shape())])
    return specs


def receive(info: dict) -> None:
    specs = [
        ParamSpec.from_json(i) for i in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
    ]
    plan = plan_buckets(specs, info["bucket_bytes"])
    buffers = BUFFERS.carve([bucket_nbytes(specs, bucket) for bucket in plan])
    base_ok = info["delta_base"] is not None and BUFFERS.token == info["delta_base"]
    BUFFERS.token = STATE["pending_token"] = None
    VERIFY.update(checked=0, failed=None, error="")
    if info["delta_base"] is None:
        incoming = Incoming(STATE["group"], buffers)
    else:
        units = [bucket_unit([specs[i] for i in bucket]) for bucket in plan]
        incoming = DeltaIncoming(STATE["group"], buffers, units, base_ok)
    payloads = []
    try:  # every bucket first, then the copies: nothing here competes with the wire for the cores
        for index in range(len(plan)):
            try:
                payloads.append(incoming.wait(index))
            except VerifyError as error:
                VERIFY.update(failed=index, error=str(error))
                raise
            VERIFY["checked"] = index + 1
    finally:
        incoming.drain()
    STATE["pending_token"] = info["token"]
    for payload, bucket in zip(payloads, plan, strict=True):
        for name, tensor in unpack_bucket(payload, [specs[i] for i in bucket]):
            STATE["weights"][name] = tensor.clone()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def reply(self, payload: dict, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/health":
            self.reply({})
        elif path == "/get_world_size":
            self.reply({"world_size": 1})
        elif path == "/state":
            sums = {n: float(t.double().sum()) for n, t in STATE["weights"].items()}
            self.reply({"version": STATE["version"], "paused": STATE["paused"], "sums": sums})
        else:
            self.reply({"error": path}, 404)

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        try:
            self.reply(self.handle_post(path, body))
        except Exception as exc:
            self.reply({"error": repr(exc)}, 500)

    def handle_post(self, path: str, body: dict) -> dict:
        if path == "/collective_rpc":
            answers = {
                "refit_transfer_backend": lambda: "refit_gloo",
                "refit_checkpoint_specs": lambda: checkpoint_specs(MODEL_DIR),
                "refit_last_verify": VERIFY.copy,
            }
            return {"results": [answers[body["method"]]()]}
        if path == "/init_weight_transfer_engine":
            info = body["init_info"]
            STATE["group"] = join_gloo_group(
                info["host"], info["port"], 1, info["world_size"], info["timeout_s"]
            )
        elif path == "/update_weights":
            receive(body["update_info"])
        elif path == "/finish_weight_update":
            STATE["version"] = body["weight_version"]
            BUFFERS.token, STATE["pending_token"] = STATE["pending_token"], None
        elif path in ("/pause", "/resume"):
            STATE["paused"] = path == "/pause"
        elif path == "/reset_prefix_cache":
            return {"success": True}
        return {}


if __name__ == "__main__":
    MODEL_DIR = Path(sys.argv[1])
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()
