"""A real ``tokenmill serve`` with several API keys, a SQLite Responses store and a record file: each stored
response is read, continued and deleted only with the key that created it; a restart keeps the store; the
record file names no stored response; one client's half-open connections leave another client served."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from serverproc import ServerProcess

KEYS = ("key-alice", "key-bob")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _serve(tmp_path: Path, *extra: str) -> ServerProcess:
    key_file = tmp_path / "keys.txt"
    key_file.write_text(f"# the team's keys\n{KEYS[1]}\n")
    return ServerProcess(
        "--api-key", KEYS[0], "--api-key-file", str(key_file), "--response-store", f"sqlite:{tmp_path / 'r.sqlite3'}",
        *extra,
    ).start()  # fmt: skip


def test_keys_own_their_responses_and_the_store_survives_a_restart(tmp_path: Path) -> None:
    record = tmp_path / "traffic.jsonl"
    server = _serve(tmp_path, "--record", str(record))
    url = server.base_url
    try:
        r = httpx.post(
            f"{url}/v1/responses",
            json={"input": "Say hi", "max_output_tokens": 4},
            headers=_auth(KEYS[0]),
            timeout=60,
        )
        assert r.status_code == 200, r.text
        response_id = r.json()["id"]
        assert r.json()["store"] is True
        for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/input_items"):
            assert httpx.get(url + path, headers=_auth(KEYS[0]), timeout=10).status_code == 200
            assert httpx.get(url + path, headers=_auth(KEYS[1]), timeout=10).status_code == 404  # not bob's
            assert httpx.get(url + path, timeout=10).status_code == 401
        assert (
            httpx.delete(f"{url}/v1/responses/{response_id}", headers=_auth(KEYS[1]), timeout=10).status_code
            == 404
        )
        bob = httpx.post(f"{url}/v1/responses", json={"input": "More", "previous_response_id": response_id,
                                                       "max_output_tokens": 2}, headers=_auth(KEYS[1]), timeout=60)  # fmt: skip
        assert bob.status_code == 404 and bob.json()["error"]["param"] == "previous_response_id"
    finally:
        assert server.stop() == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    recorded = [line["request_id"] for line in lines if line.get("kind") == "request"]
    assert recorded and all(
        response_id not in rid and response_id.removeprefix("resp_") not in rid for rid in recorded
    )
    assert all(rid.startswith("resp-") and rid.endswith("-0") for rid in recorded)

    again = _serve(tmp_path)
    try:
        r = httpx.post(f"{again.base_url}/v1/responses", json={"input": "And again", "previous_response_id": response_id,
                                                               "max_output_tokens": 2}, headers=_auth(KEYS[0]), timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert (
            httpx.get(
                f"{again.base_url}/v1/responses/{response_id}", headers=_auth(KEYS[0]), timeout=10
            ).status_code
            == 200
        )
        assert (
            httpx.delete(
                f"{again.base_url}/v1/responses/{response_id}", headers=_auth(KEYS[0]), timeout=10
            ).status_code
            == 200
        )
        assert (
            httpx.get(
                f"{again.base_url}/v1/responses/{response_id}", headers=_auth(KEYS[0]), timeout=10
            ).status_code
            == 404
        )
    finally:
        again.stop()


def test_one_clients_half_open_connections_leave_another_client_served(tmp_path: Path) -> None:
    server = ServerProcess("--max-connections-per-client", "64", "--header-timeout", "30").start()
    held: list[socket.socket] = []
    try:
        for _ in range(1_100):  # from 127.0.0.1, never finishing a request
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
            try:
                s.connect(("127.0.0.1", server.port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                s.close()
                continue
            held.append(s)
        time.sleep(0.5)
        refused = 0
        for s in held[64:80]:  # past this client's share: answered, in JSON, and closed
            s.settimeout(5)
            data = s.recv(4096)
            if data.startswith(b"HTTP/1.1 503"):
                refused += 1
                body = json.loads(data.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["code"] == "too_many_connections"
        assert refused == 16
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60)
        r = other.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert other.get(f"{server.base_url}/health").status_code == 200
    finally:
        for s in held:
            s.close()
        server.stop()
    assert "Traceback" not in server.output()


@pytest.mark.parametrize(
    "flag", [("--api-key-file", "/nonexistent/keys"), ("--response-store", "postgres://x")]
)
def test_bad_store_or_key_flags_stop_the_start_with_a_message(flag: tuple[str, str]) -> None:
    server = ServerProcess(*flag).launch()
    assert server.proc is not None
    assert server.proc.wait(120) == 2
    assert flag[0] in server.output()
