"""Test harness: real nginx, nats-server and kvworker processes on loopback.

Every process is started in its own session and registered with a Stack;
Stack.close() (run by the pytest fixtures even when a test fails, and by
atexit) terminates them all. Ports are drawn at random below the kernel's
ephemeral range and checked free (free_port), so tests can run while a demo
stack holds 8080.
"""
import atexit
import collections
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# absolute: nginx resolves load_module against its own prefix, a temporary
# directory, so a relative KVROUTE_BUILD (KVROUTE_BUILD=build tools/...) would
# fail `nginx -t` there
BUILD = os.path.abspath(os.environ.get("KVROUTE_BUILD", os.path.join(TOP, "build")))
SANITIZE = os.environ.get("KVROUTE_SANITIZE", "0") == "1"
BIN = os.path.join(BUILD, "bin")
MODULE = os.path.join(BUILD, "modules", "ngx_http_kvroute_module.so")
NGINX = os.environ.get("KVROUTE_NGINX", "/usr/sbin/nginx")
NATS_SERVER = os.environ.get("KVROUTE_NATS_SERVER",
                             shutil.which("nats-server") or "/usr/sbin/nats-server")

_live = []


def _reap_all():
    for p in list(_live):
        _kill(p)


atexit.register(_reap_all)


def _kill(proc, sig=signal.SIGTERM, timeout=5.0):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc in _live:
        _live.remove(proc)


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
            return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_ports = random.Random(os.getpid() ^ time.monotonic_ns())
# ports handed out lately: a process started with wait=False binds its port
# later, and until then a bind test alone would hand the same port out again
_handed = collections.deque(maxlen=256)


def _port_range():
    """The 8,192 ports just below the kernel's ephemeral range, or this
    process's share of them: t/run.py runs test files side by side and gives
    each running file its own slice (KVROUTE_TEST_SLICE=i/n), so two files
    never draw the same port between the bind check and their server's own
    bind."""
    lo, _ = _ephemeral_range()
    start, end = max(lo - 8192, 1024), max(lo, 1025)
    try:
        i, n = (int(x) for x in os.environ["KVROUTE_TEST_SLICE"].split("/"))
    except (KeyError, ValueError):
        return start, end
    if not 0 <= i < n:
        return start, end
    size = (end - start) // n
    return start + i * size, start + (i + 1) * size


def free_port(room=1):
    """A loopback port nobody listens on right now, below the kernel's
    ephemeral range: a port the kernel hands out for bind(0) can be taken,
    before the process we start binds it, as the local port of any outgoing
    connection (every test opens many), and the process then exits with
    "address in use". Below the range only an explicit bind can take it.
    test_scale takes its runs of 4,096 from further down, where no server of
    ours has left a connection in TIME_WAIT (which refuses a bind to its
    port). room: the port and the room - 1 after it stay in the range."""
    start, end = _port_range()
    for _ in range(100):
        port = _ports.randrange(start, max(end - room + 1, start + 1))
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed.append(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n, consecutive=False):
    """n free ports; consecutive=True for kvworker --engines N."""
    if not consecutive:
        return [free_port() for _ in range(n)]
    for _ in range(200):
        base = free_port(n)
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                if p in _handed and p != base:
                    raise OSError("handed out already")
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            _handed.extend(range(base + 1, base + n))
            return list(range(base, base + n))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of %d free ports" % n)


def wait_port(port, timeout=30.0, proc=None, what="process"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("%s exited with %s before listening on %d"
                               % (what, proc.returncode, port))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("%s did not listen on %d within %.0fs" % (what, port, timeout))


def sanitizer_env(env=None):
    env = dict(os.environ if env is None else env)
    if SANITIZE:
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    return env


class Stack:
    """Processes and files belonging to one test; close() undoes all of it."""

    def __init__(self, name="kvt"):
        self.dir = tempfile.mkdtemp(prefix=name + "-")
        # nginx started as root runs its workers as nobody: they must reach
        # their temp paths under this directory
        os.chmod(self.dir, 0o755)
        self.procs = []
        self.nginxes = []

    def spawn(self, argv, log, env=None):
        out = open(os.path.join(self.dir, log), "ab")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env, start_new_session=True, cwd=self.dir)
        out.close()
        p.log = os.path.join(self.dir, log)
        self.procs.append(p)
        _live.append(p)
        return p

    def nats(self, jetstream=False, port=None):
        port = port or free_port()
        argv = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(port)]
        if jetstream:
            sd = os.path.join(self.dir, "js-%d" % port)
            argv += ["-js", "-sd", sd]
        p = self.spawn(argv, "nats-%d.log" % port)
        wait_port(port, proc=p, what="nats-server")
        p.port = port
        p.url = "nats://127.0.0.1:%d" % port
        return p

    def worker(self, port=None, engines=1, extra=(), wait=True):
        """kvworker --engine mock; returns the process with .ports."""
        if port is None:
            ports = free_ports(engines, consecutive=engines > 1)
            port = ports[0]
        argv = [os.path.join(BIN, "kvworker"), "--engine", "mock", "--port", str(port),
                "--engines", str(engines)] + list(extra)
        p = self.spawn(argv, "worker-%d.log" % port, env=sanitizer_env())
        p.ports = list(range(port, port + engines))
        if wait:
            for q in p.ports:
                wait_port(q, proc=p, what="kvworker")
        return p

    @staticmethod
    def ready(*workers):
        """Waits until each worker started with wait=False listens on all its
        ports: workers started together load their models and tokenizers at
        once, not one after the other."""
        for w in workers:
            for q in w.ports:
                wait_port(q, proc=w, what="kvworker")
        return workers

    def nginx(self, http_conf, main_conf="", port=None, workers=2, wait=True, start=True):
        """Starts nginx in the foreground (master + workers) with the module
        loaded. http_conf is the body of http {}; '%(port)s' in it is the
        listening port. Returns an Nginx handle; start=False only writes the
        configuration (for `nginx -t` through check())."""
        n = Nginx(self, http_conf, main_conf, port or free_port(), workers)
        if start:
            n.start(wait=wait)
        self.nginxes.append(n)
        return n

    def nginx_t(self, http_conf):
        """`nginx -t` of http_conf, nothing started: (ok, output, conf path)."""
        n = self.nginx(http_conf, start=False)
        return n.check() + (n.conf,)

    def close(self):
        for n in self.nginxes:
            n.stop()
        for p in reversed(self.procs):
            _kill(p)


class Nginx:
    def __init__(self, stack, http_conf, main_conf, port, workers):
        self.stack = stack
        self.port = port
        self.prefix = os.path.join(stack.dir, "nginx-%d" % port)
        os.makedirs(os.path.join(self.prefix, "logs"), exist_ok=True)
        self.conf = os.path.join(self.prefix, "nginx.conf")
        self.error_log = os.path.join(self.prefix, "logs", "error.log")
        self.write_conf(http_conf, main_conf, workers)
        self.proc = None

    def write_conf(self, http_conf, main_conf="", workers=2):
        self.workers = workers
        body = http_conf.replace("%(port)s", str(self.port))
        with open(self.conf, "w") as f:
            f.write("""load_module %(module)s;
worker_processes %(workers)d;
error_log %(prefix)s/logs/error.log info;
pid %(prefix)s/nginx.pid;
%(main)s
events { worker_connections 1024; }
http {
    access_log %(prefix)s/logs/access.log;
    client_body_temp_path %(prefix)s/body;
    proxy_temp_path %(prefix)s/proxy;
    fastcgi_temp_path %(prefix)s/fastcgi;
    uwsgi_temp_path %(prefix)s/uwsgi;
    scgi_temp_path %(prefix)s/scgi;
%(body)s
}
""" % {"module": MODULE, "workers": workers, "prefix": self.prefix, "main": main_conf,
       "body": body})

    def env(self):
        env = sanitizer_env()
        if SANITIZE:
            asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                                  text=True).stdout.strip()
            ubsan = subprocess.run(["gcc", "-print-file-name=libubsan.so"], capture_output=True,
                                   text=True).stdout.strip()
            env["LD_PRELOAD"] = asan + ":" + ubsan
        return env

    def check(self):
        """nginx -t; returns (ok, output)."""
        r = subprocess.run([NGINX, "-t", "-p", self.prefix, "-c", self.conf,
                            "-e", self.error_log], capture_output=True, text=True, env=self.env())
        return r.returncode == 0, r.stdout + r.stderr

    def start(self, wait=True):
        ok, out = self.check()
        if not ok:
            raise RuntimeError("nginx -t failed:\n" + out)
        self.proc = self.stack.spawn([NGINX, "-p", self.prefix, "-c", self.conf, "-e",
                                      self.error_log, "-g", "daemon off;"],
                                     "nginx-%d.out" % self.port, env=self.env())
        if wait:
            wait_port(self.port, proc=self.proc, what="nginx")

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def children(self):
        """Pids of the master's child processes (workers, helpers)."""
        r = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return {int(p) for p in r.stdout.split()}

    def reload(self, http_conf=None, main_conf="", workers=None, timeout=30.0):
        """SIGHUP, then waits until the master has started `workers` new
        worker processes (old ones may still finish their requests)."""
        if http_conf is not None:
            self.write_conf(http_conf, main_conf, workers or self.workers)
        before = self.children()
        self.signal(signal.SIGHUP)
        wait_until(lambda: len(self.children() - before) >= self.workers, timeout=timeout,
                   what="new nginx worker processes after reload")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            _kill(self.proc)

    def log(self):
        with open(self.error_log, errors="replace") as f:
            return f.read()

    def alerts(self):
        """[alert]/[emerg]/[crit] lines and sanitizer reports: none expected."""
        bad = [l for l in self.log().splitlines()
               if "[alert]" in l or "[emerg]" in l or "[crit]" in l]
        out = os.path.join(self.stack.dir, "nginx-%d.out" % self.port)
        if os.path.exists(out):
            with open(out, errors="replace") as f:
                bad += [l for l in f if "Sanitizer" in l or "runtime error" in l]
        return bad


# --- HTTP helpers ---------------------------------------------------------

def request(port, method, path, body=None, headers=None, timeout=30.0):
    """One HTTP request; returns (status, headers dict lower-cased, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        hdrs.update(headers or {})
        c.request(method, path, body=body, headers=hdrs)
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        c.close()


def post_json(port, path, obj, headers=None, timeout=30.0):
    status, hdrs, data = request(port, "POST", path, obj, headers, timeout)
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = None
    return status, hdrs, parsed, data


def sse_events(data):
    """Parses an SSE body into the list of 'data:' payloads."""
    out = []
    for block in data.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def chat(port, content, max_tokens=4, stream=False, model="kvroute-mock", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}
    body.update(extra)
    return post_json(port, "/v1/chat/completions", body)


def canned_servers(ports, reply):
    """http {} text for a trivial upstream: one server per port, each
    answering every request with the JSON text reply (benchmarks of the
    router alone)."""
    return "    access_log off;\n" + "".join(
        "    server { listen 127.0.0.1:%d; location / { default_type application/json;\n"
        "             return 200 '%s'; } }\n" % (p, reply) for p in ports)


def wait_until(pred, timeout=30.0, interval=0.05, what="condition"):
    """Polls pred until it returns a true value (returned); generous by
    default: the deadline only matters when the condition never comes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("timed out waiting for " + what)
