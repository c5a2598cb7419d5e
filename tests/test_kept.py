"""Files that keep a secret: one warning, naming the file and never what it holds, when its group or others may
read it (a password file, vLLM's secret file, a TLS private key); none when only its owner may."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

import pytest

from kvkit.backends.blockstore.valkey import ValkeyStore
from kvkit.integrations.vllm.settings import parse_extra_config
from kvkit.interfaces import KVCacheSpec
from kvkit.shared.urls import open_block_store

SECRET = b"kvkit-test-s3cr3t"
SPEC = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def _exposure_warnings(read) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read()
    return [w for w in caught if "keeps a secret" in str(w.message)]


def _kept(tmp_path, mode: int, name: str = "secret", data: bytes = SECRET + b"\n") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def _password_file(path: str) -> None:
    open_block_store(f"valkey://127.0.0.1:1/0?password_file={path}").close()


def _vllm_secret_file(path: str) -> None:
    parse_extra_config({"cpu_blocks": 8, "shared": {"url": "memory://", "secret_file": path}}, kv=SPEC,
                       gpu_blocks=16, world_size=1, device="cpu")


@pytest.mark.parametrize("read", [_password_file, _vllm_secret_file], ids=["password_file", "secret_file"])
@pytest.mark.parametrize(("mode", "readers"), [(0o644, "its group and others"), (0o640, "its group"),
                                               (0o604, "others"), (0o600, None), (0o400, None)])
def test_a_secret_file_others_may_read_is_warned_about_by_name_only(tmp_path, read, mode, readers):
    """Read all the same; the warning names the option and the path and says who may read it, never the secret."""
    path = _kept(tmp_path, mode)
    caught = _exposure_warnings(lambda: read(path))
    if readers is None:
        assert caught == []
        return
    (warning,) = caught
    text = str(warning.message)
    assert path in text and f"{readers} may read it" in text and f"mode {mode:04o}" in text, text
    assert SECRET.decode() not in text and warning.category is UserWarning
    assert warning.filename == __file__


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
@pytest.mark.parametrize("apart", [True, False], ids=["tls_key", "key-in-tls_cert"])
def test_a_tls_private_key_others_may_read_is_warned_about(tmp_path, apart):
    """The client's private key (``tls_key``, or the certificate's file when it holds the key too): 0644 warns,
    naming the file; 0600 does not."""
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                    "-days", "1", "-keyout", key, "-out", cert], check=True, capture_output=True)
    if not apart:
        cert.write_bytes(cert.read_bytes() + key.read_bytes())
    holder = key if apart else cert
    options = {"tls_key": str(key)} if apart else {}

    def open_store():
        ValkeyStore([("127.0.0.1", 1)], tls=True, tls_ca=str(cert), tls_cert=str(cert), **options).close()

    for mode, warned in ((0o644, True), (0o600, False)):
        os.chmod(holder, mode)
        caught = _exposure_warnings(open_store)
        assert [str(holder) in str(w.message) for w in caught] == ([True] if warned else []), caught
