"""runtime/ik_build.py without compiling: where the pinned tarball is looked for, and the patched source tree."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from runtime import ik_build


def test_a_missing_tarball_names_every_place_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(ik_build, "_REPO", tmp_path / "repo")
    monkeypatch.delenv(ik_build.ENV_TARBALL, raising=False)
    with pytest.raises(ik_build.IkSourceMissing) as e:
        ik_build.find_tarball()
    msg = str(e.value)
    assert str(tmp_path / "repo" / "vendor" / ik_build.TARBALL_NAME) in msg
    assert ik_build.ENV_TARBALL in msg
    assert "shared" not in msg          # the product looks only in its own vendor/ (users have no ../shared)


def test_the_environment_wins_then_the_repository_copy(tmp_path, monkeypatch):
    own = tmp_path / "x.tar.xz"
    own.write_bytes(b"")
    monkeypatch.setenv(ik_build.ENV_TARBALL, str(own))
    assert ik_build.find_tarball() == own
    monkeypatch.delenv(ik_build.ENV_TARBALL)
    assert ik_build.find_tarball() == Path(ik_build.__file__).resolve().parents[1] / "vendor" / ik_build.TARBALL_NAME


def test_a_wrong_checksum_is_refused(tmp_path):
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(b"not the pinned source")
    with pytest.raises(ik_build.IkBuildError, match="sha256"):
        ik_build.prepare_source(tmp_path / "out", bad)


def test_the_server_tarball_is_looked_for_beside_the_given_one(tmp_path, monkeypatch):
    own = tmp_path / "x.tar.xz"
    monkeypatch.setenv(ik_build.ENV_TARBALL, str(own))
    assert ik_build.tarball_candidates(ik_build.SERVER_TARBALL_NAME)[0] == tmp_path / ik_build.SERVER_TARBALL_NAME


def test_a_wrong_server_checksum_is_refused(tmp_path):
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(b"not the pinned server source")
    with pytest.raises(ik_build.IkBuildError, match="sha256"):
        ik_build.add_server_source(bad, tmp_path / "src")


def test_the_source_tree_is_patched_for_the_pruned_tarball(tmp_path):
    src = ik_build.prepare_source(tmp_path)
    examples = (src / "examples" / "CMakeLists.txt").read_text()
    assert "add_subdirectory(sweep-bench)" in examples
    # the server (and mtmd, which it links) only with LLAMA_BUILD_SERVER and its source in the tree
    assert "if (LLAMA_BUILD_SERVER AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/server/CMakeLists.txt)" in examples
    assert ik_build.has_server_source(src) and (src / "examples" / "mtmd" / "mtmd.cpp").is_file()
    assert (src / "vendor" / "miniaudio" / "miniaudio.h").is_file() and (src / "scripts" / "xxd.cmake").is_file()
    for rel in ("public/index.html.gz", "public_llamacpp/index_llamacpp.html.gz"):   # the stand-in web pages
        assert b"no web UI" in gzip.decompress((src / "examples" / "server" / rel).read_bytes())
    assert "\n    add_subdirectory(pocs)" not in (src / "CMakeLists.txt").read_text()
    info = (src / "cmake" / "build-info.cmake").read_text()
    assert f"set(BUILD_NUMBER {ik_build.IK_BUILD_NUMBER})" in info and 'set(BUILD_COMMIT "8337e4cd")' in info
