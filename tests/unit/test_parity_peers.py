"""``benchmarks.peers``: fetching is idempotent, a wheel that cannot be fetched or that is
not the pinned bytes is recorded as missing (and a check skips with that reason), and an
extracted copy that was changed is refused."""

import shutil

import pytest

from benchmarks import peers


def fake_download(calls, source=None):
    def download(name, version, dest):
        calls.append(name)
        if source is None or not source.name.startswith(peers.wheel_prefix(name, version)):
            return "no network"
        shutil.copy(source, dest / source.name)
        return None
    return download


def test_fetch_downloads_once_and_records_what_it_could_not(tmp_path):
    pins = {"dflash": peers.PINS["dflash"], "nowhere": peers.Pin("1.0", "0" * 64)}
    try:
        wheel = peers.peer("dflash").wheel
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    calls = []
    first = peers.fetch(tmp_path, pins, fake_download(calls, wheel))
    assert first["peers"]["dflash"] == {"version": "0.1.0", "wheel": wheel.name, "sha256": pins["dflash"].sha256}
    assert first["peers"]["nowhere"]["missing"].endswith("failed: no network")
    calls.clear()
    assert peers.fetch(tmp_path, pins, fake_download(calls)) == first and calls == ["nowhere"]


def test_a_wheel_with_other_bytes_is_missing_and_a_changed_copy_is_refused(tmp_path, monkeypatch):
    try:
        wheel = peers.peer("dflash").wheel
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    bad = peers.Pin("0.1.0", "1" * 64)
    got = peers.fetch(tmp_path, {"dflash": bad}, fake_download([], wheel))
    assert "the pin says" in got["peers"]["dflash"]["missing"] and not list(tmp_path.glob("*.whl"))
    monkeypatch.setattr(peers, "PINS", {"dflash": bad})
    with pytest.raises(peers.PeerUnavailable, match="the pin says"):
        peers.peer("dflash", tmp_path)
    monkeypatch.undo()
    peers.fetch(tmp_path, {"dflash": peers.PINS["dflash"]}, fake_download([], wheel))
    p = peers.peer("dflash", tmp_path)
    root = peers.extracted(p)
    (root / "dflash" / "model.py").write_text("print('not z-lab')\n")
    with pytest.raises(RuntimeError, match="differs from"):
        peers.extracted(p)
