"""Building and installing the module the ways nginx users do (docs/INSTALL.md).

- tools/build-against-nginx compiles the module with the self-contained
  ./config (every src layer compiled inside nginx's build, no libkvcore.a)
  against Debian's /usr/share/nginx/src, and the result loads into
  /usr/sbin/nginx.
- More nginx source trees (nginx.org or freenginx tarballs, unpacked) can be
  named in KVROUTE_NGINX_SOURCES (colon-separated): each is built with and
  without --with-threads. Skipped when none is named (no network here).
"""

import os
import subprocess

import pytest

import kvt

TOOL = os.path.join(kvt.TOP, "tools", "build-against-nginx")
DEBIAN_SRC = "/usr/share/nginx/src"
SOURCES = [s for s in os.environ.get("KVROUTE_NGINX_SOURCES", "").split(":") if s]


def build(src, out, *extra):
    argv = [TOOL, src, "--out", out]
    if extra:
        argv += ["--"] + [a for a in extra if a]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    so = r.stdout.strip().splitlines()[-1]
    assert so.endswith("ngx_http_kvroute_module.so") and os.path.isfile(so)
    return so


def sanitized_env():
    """What nginx needs to load a module built with SANITIZE=1."""
    env = dict(os.environ)
    if kvt.SANITIZE:
        libs = [subprocess.run(["gcc", "-print-file-name=lib%s.so" % n], capture_output=True,
                               text=True).stdout.strip() for n in ("asan", "ubsan")]
        env["LD_PRELOAD"] = ":".join(libs)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def nginx_t(nginx, prefix, so, http_conf, env=None):
    os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write("load_module %s;\npid %s/nginx.pid;\nevents {}\nhttp {\n%s\n}\n"
                % (so, prefix, http_conf))
    r = subprocess.run([nginx, "-t", "-p", prefix, "-c", conf, "-e",
                        os.path.join(prefix, "logs", "error.log")],
                       capture_output=True, text=True, env=env)
    return r.returncode == 0, r.stdout + r.stderr


UPSTREAM = """
    kvroute_zone kv 8m;
    upstream u { kvroute zone=kv mode=approximate %s; server 127.0.0.1:1; }
    server { listen 127.0.0.1:1; location / { kvroute_upstream u; proxy_pass http://u; } }
"""


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEBIAN_SRC, "configure")),
                    reason="no nginx source tree at /usr/share/nginx/src (package nginx-dev)")
def test_self_contained_config_builds_against_debian_tree(tmp_path):
    so = build(DEBIAN_SRC, str(tmp_path / "b"))

    # it carries the layers itself: nothing links against libkvcore.a
    objs = subprocess.run(["find", str(tmp_path / "b" / "addon"), "-name", "*.o"],
                          capture_output=True, text=True).stdout.split()
    layers = {os.path.basename(os.path.dirname(o)) for o in objs}
    assert {"core", "text", "index", "events", "route", "ngx"} <= layers

    ok, out = nginx_t(kvt.NGINX, str(tmp_path / "p"), so, UPSTREAM % "")
    assert ok, out

    # Debian's nginx has threads: an undeclared pool is refused by nginx
    ok, out = nginx_t(kvt.NGINX, str(tmp_path / "p"), so, UPSTREAM % "thread_pool=nope")
    assert not ok and 'unknown thread pool "nope"' in out, out


@pytest.mark.skipif(not SOURCES, reason="KVROUTE_NGINX_SOURCES names no nginx source tree")
@pytest.mark.parametrize("threads", [True, False], ids=["threads", "no-threads"])
def test_builds_against_named_source_trees(tmp_path, threads):
    for src in SOURCES:
        # nginx < 1.22 looks for PCRE1, which Debian 12 lacks: leave out rewrite
        extra = ["--with-threads" if threads else "", "--without-http_rewrite_module"]
        build(src, str(tmp_path / os.path.basename(src.rstrip("/"))), *extra)


@pytest.mark.skipif(not SOURCES, reason="KVROUTE_NGINX_SOURCES names no nginx source tree")
def test_thread_pool_refused_without_threads(tmp_path):
    """An nginx built without --with-threads: thread_pool= fails nginx -t
    with a message that says why; without it the module loads."""
    src = SOURCES[-1]
    out = str(tmp_path / "b")
    r = subprocess.run([TOOL, src, "--out", out, "--binary", "--",
                        "--without-http_rewrite_module", "--without-http_gzip_module"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    nginx = os.path.join(out, "nginx")
    so = os.path.join(out, "ngx_http_kvroute_module.so")

    ok, log = nginx_t(nginx, str(tmp_path / "p"), so, UPSTREAM % "")
    assert ok, log
    ok, log = nginx_t(nginx, str(tmp_path / "p"), so, UPSTREAM % "thread_pool=nope")
    assert not ok and "needs nginx built with --with-threads" in log, log


def test_make_install_into_destdir(tmp_path):
    """make install DESTDIR=... PREFIX=/usr lays out the module, its load
    snippet (linked from modules-enabled, as Debian's packages do), kvworker,
    the tools and the bundled tokenizers; the installed module loads."""
    dest = str(tmp_path / "root")
    b = os.path.relpath(kvt.BUILD, kvt.TOP)
    r = subprocess.run(["make", "-s", "-C", kvt.TOP, "install", "B=" + b, "DESTDIR=" + dest,
                        "PREFIX=/usr"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr

    so = os.path.join(dest, "usr/lib/nginx/modules/ngx_http_kvroute_module.so")
    snippet = os.path.join(dest, "usr/share/nginx/modules-available/mod-http-kvroute.conf")
    link = os.path.join(dest, "etc/nginx/modules-enabled/50-mod-http-kvroute.conf")
    assert os.path.isfile(so)
    with open(snippet) as f:
        assert f.read().strip() == \
            "load_module /usr/lib/nginx/modules/ngx_http_kvroute_module.so;"
    assert os.readlink(link) == "/usr/share/nginx/modules-available/mod-http-kvroute.conf"
    for tool in ("kvworker", "kvtok", "kvbench"):
        assert os.access(os.path.join(dest, "usr/bin", tool), os.X_OK), tool
    assert os.path.isdir(os.path.join(dest, "usr/share/kvroute/tokenizers"))

    ok, out = nginx_t(kvt.NGINX, str(tmp_path / "p"), so, UPSTREAM % "", env=sanitized_env())
    assert ok, out


DEB_DIR = os.path.join(kvt.TOP, "build", "deb")


def debs():
    return sorted(f for f in os.listdir(DEB_DIR) if f.endswith(".deb")) \
        if os.path.isdir(DEB_DIR) else []


@pytest.mark.skipif(not os.environ.get("KVROUTE_TEST_DEB") and not debs(),
                    reason="make deb takes about 3 minutes: run it first, or set KVROUTE_TEST_DEB=1")
def test_deb_packages_hold_module_snippet_and_worker(tmp_path):
    if os.environ.get("KVROUTE_TEST_DEB"):
        r = subprocess.run(["make", "-s", "-C", kvt.TOP, "deb"], capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, r.stdout + r.stderr

    mod = [d for d in debs() if d.startswith("libnginx-mod-http-kvroute_")]
    wrk = [d for d in debs() if d.startswith("kvroute-worker_")]
    assert mod and wrk, debs()

    root = str(tmp_path / "root")
    for d in (mod[0], wrk[0]):
        subprocess.run(["dpkg-deb", "-x", os.path.join(DEB_DIR, d), root], check=True)
    assert os.path.isfile(os.path.join(root, "usr/lib/nginx/modules/ngx_http_kvroute_module.so"))
    with open(os.path.join(root, "usr/share/nginx/modules-available/mod-http-kvroute.conf")) as f:
        assert "load_module modules/ngx_http_kvroute_module.so;" in f.read()
    assert os.access(os.path.join(root, "usr/bin/kvworker"), os.X_OK)

    depends = subprocess.run(["dpkg-deb", "-f", os.path.join(DEB_DIR, mod[0]), "Depends"],
                             capture_output=True, text=True, check=True).stdout
    assert "nginx-abi-" in depends, depends
    postinst = subprocess.run(["dpkg-deb", "-I", os.path.join(DEB_DIR, mod[0]), "postinst"],
                              capture_output=True, text=True, check=True).stdout
    assert "modules-enabled" in postinst

    ok, out = nginx_t(kvt.NGINX, str(tmp_path / "p"),
                      os.path.join(root, "usr/lib/nginx/modules/ngx_http_kvroute_module.so"),
                      UPSTREAM % "")
    assert ok, out
