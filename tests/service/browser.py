"""A real headless Chromium for the web-view tests, from Debian's packages: the system's (apt-get install chromium
chromium-driver), else a copy unpacked without root into ~/.cache/offload-tuner/chromium (apt-get download of
chromium, chromium-common, chromium-driver and the shared libraries they need that the machine lacks, each
unpacked with dpkg-deb -x, run with LD_LIBRARY_PATH), the way a CI without root gets it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("OFFLOAD_TUNER_CACHE", Path.home() / ".cache" / "offload-tuner")) / "chromium"
ROOTS = ("chromium", "chromium-common", "chromium-driver")
MAX_PACKAGES = 80          # a bound on the dependency walk (the libraries chromium needs are ~20 on Debian 12)


class Unavailable(Exception):
    """No Chromium can be had on this machine; the message says why."""


@dataclass(frozen=True)
class Browser:
    chromium: str
    chromedriver: str
    env: dict[str, str]          # extra environment (LD_LIBRARY_PATH for an unpacked copy)


def find() -> Browser:
    sys_chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    sys_driver = shutil.which("chromedriver")
    if sys_chromium and sys_driver:
        return Browser(sys_chromium, sys_driver, {})
    cached = _cached()
    if cached is not None:
        return cached
    _unpack()
    cached = _cached()
    if cached is None:
        raise Unavailable(f"unpacked Debian's chromium into {CACHE} but it does not run; "
                          "install it: apt-get install chromium chromium-driver")
    return cached


def _cached() -> Browser | None:
    root = CACHE / "root"
    chromium = root / "usr/lib/chromium/chromium"
    driver = root / "usr/bin/chromedriver"
    if not (chromium.is_file() and driver.is_file()):
        return None
    libdirs = [str(p) for p in (root / "usr/lib/x86_64-linux-gnu", root / "usr/lib/x86_64-linux-gnu/pulseaudio",
                                root / "lib/x86_64-linux-gnu", root / "usr/lib/chromium") if p.is_dir()]
    env = {"LD_LIBRARY_PATH": os.pathsep.join([*libdirs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])}
    probe = subprocess.run([str(chromium), "--version"], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=60)
    if probe.returncode != 0:
        return None
    return Browser(str(chromium), str(driver), env)


def _installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return r.returncode == 0 and "install ok installed" in r.stdout


def _depends(pkg: str) -> list[str]:
    """Direct Depends of PKG, the first of each group of alternatives."""
    r = subprocess.run(["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                        "--no-breaks", "--no-replaces", "--no-enhances", pkg], capture_output=True, text=True)
    out, skip_next = [], False
    for line in r.stdout.splitlines()[1:]:
        s = line.strip()
        alt = s.startswith("|")
        s = s.lstrip("|")
        if not s.startswith("Depends:"):
            continue
        name = s.split(":", 1)[1].strip()
        if not skip_next and not name.startswith("<"):
            out.append(name.split(":")[0])
        skip_next = alt              # the next line is an alternative to this one
    return out


def _unpack() -> None:
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "dpkg-query"):
        if shutil.which(tool) is None:
            raise Unavailable(f"no chromium on PATH and no {tool} to fetch Debian's (not a Debian-like system)")
    # the packages to unpack: chromium's own and the shared libraries (lib*) it needs that are not installed
    want, queue = [], list(ROOTS)
    while queue and len(want) < MAX_PACKAGES:
        pkg = queue.pop(0)
        if pkg in want or (pkg not in ROOTS and (not pkg.startswith("lib") or _installed(pkg))):
            continue
        want.append(pkg)
        queue += _depends(pkg)
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        r = subprocess.run(["apt-get", "download", *want], cwd=tmp, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise Unavailable(f"no chromium on PATH and apt-get download failed ({last}); install chromium "
                              "chromium-driver, or run apt-get update first")
        staging = Path(tmp) / "root"
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, timeout=600)
        if (CACHE / "root").exists():
            shutil.rmtree(CACHE / "root")
        staging.rename(CACHE / "root")


def options(b: Browser, width: int = 1400, height: int = 1000):
    from selenium.webdriver.chrome.options import Options
    o = Options()
    o.binary_location = b.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions",
                "--force-device-scale-factor=1"):
        o.add_argument(arg)
    return o


def driver(b: Browser):
    """A Selenium WebDriver on that Chromium (chromedriver from the same packages; nothing downloaded)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    service = Service(executable_path=b.chromedriver, env={**os.environ, **b.env})
    return webdriver.Chrome(service=service, options=options(b))
