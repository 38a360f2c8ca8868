package pyenv

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// requireTools skips a test that builds environments where it cannot.
func requireTools(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("bwrap"); err != nil {
		t.Skip("bwrap (Debian package bubblewrap) is not installed")
	}
	if _, err := os.Stat(debianPython); err != nil {
		t.Skip(debianPython + " (Debian package python3) is not installed")
	}
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git is not installed")
	}
}

func git(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	cmd.Env = append(gitEnv(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com",
		"GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com", "GIT_CONFIG_NOSYSTEM=1", "HOME="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}

// makeRepo makes a git repository in a temporary directory holding files,
// committed, and returns it and the commit.
func makeRepo(t *testing.T, files map[string]string) (dir, commit string) {
	t.Helper()
	dir = t.TempDir()
	git(t, dir, "init", "-q", "-b", "main")
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git(t, dir, "add", "-A")
	git(t, dir, "commit", "-q", "-m", "init")
	return dir, git(t, dir, "rev-parse", "HEAD")
}

// workTree is an episode's work tree: another clone of the repository, at
// commit, whose files the test may change.
func workTree(t *testing.T, repo, commit string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tree")
	git(t, filepath.Dir(dir), "clone", "-q", repo, dir)
	git(t, dir, "checkout", "-q", "--detach", commit)
	return dir
}

// inSandbox runs argv as a test would: in bubblewrap, the host's root
// read-only, the work tree bound at /work and the working directory, a
// writable temporary directory, the cache directory at SandboxRoot, with
// the environment's Vars.
func inSandbox(t *testing.T, e *Env, tree string, argv ...string) (string, error) {
	t.Helper()
	tmp := t.TempDir() // the host's /tmp is read-only in there
	sb, err := sandboxArgs(tree, "/work", [][2]string{{tmp, tmp}, {filepath.Dir(filepath.Dir(e.Dir)), SandboxRoot}})
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bwrap", append(sb, argv...)...)
	cmd.Env = []string{"HOME=" + tmp, "TMPDIR=" + tmp, "LANG=C.UTF-8"}
	for k, v := range e.Vars("") {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// logs is a slog handler's output that tests read.
type logs struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logs) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

func newLog(t *testing.T) (*slog.Logger, *logs) {
	l := &logs{}
	return slog.New(slog.NewTextHandler(l, nil)), l
}

func with(pkgs ...string) []string { return append(Packages("example/unknown"), pkgs...) }

// noLeftovers checks that a cache directory holds no build's temporary
// directory.
func noLeftovers(t *testing.T, cacheDir string) {
	t.Helper()
	if m, _ := filepath.Glob(filepath.Join(cacheDir, "*.build-*")); len(m) > 0 {
		t.Errorf("temporary build directories left: %v", m)
	}
}

// A src-layout pyproject.toml package named like a Debian package
// (python3-toml) is installed editable from /work/src: the work tree's
// package comes first, Debian's attr is importable, pytest (a console
// script the venv makes for Debian's pytest) passes; the second Ensure is
// cached.
func TestSrcLayoutPyproject(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, map[string]string{
		"pyproject.toml": `[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "toml"
version = "0.0.1"
`,
		"src/toml/__init__.py": "WHERE = 'build'\n",
		"tests/test_toml.py": `import os

import attr
import toml


def test_work_tree_first():
    assert toml.__file__ == "/work/src/toml/__init__.py", toml.__file__
    assert toml.WHERE == "episode"


def test_debian_dependency():
    assert os.path.realpath(attr.__file__).startswith("/usr/lib/python3/dist-packages/"), attr.__file__
`,
	})
	cache := t.TempDir()
	log, logged := newLog(t)
	req := Request{Repo: "example/toml", Clone: repo, Commit: commit, Debian: with("python3-attr", "python3-toml")}
	start := time.Now()
	e, err := Ensure(context.Background(), cache, req, log)
	if err != nil {
		t.Fatal(err)
	}
	first := time.Since(start)
	if e.Cached || e.BuildS <= 0 || e.Editable != "pep660" || e.Commit != commit || e.Python == "" {
		t.Fatalf("first Ensure: %+v", e)
	}
	if e.Dir != filepath.Join(cache, e.Key, "venv") {
		t.Fatalf("Dir %s, want %s", e.Dir, filepath.Join(cache, e.Key, "venv"))
	}
	if logged.count("pyenv: building") != 1 || logged.count("pyenv: built") != 1 {
		t.Fatalf("logs:\n%s", logged.b.String())
	}

	tree := workTree(t, repo, commit)
	if err := os.WriteFile(filepath.Join(tree, "src/toml/__init__.py"), []byte("WHERE = 'episode'\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := inSandbox(t, e, tree, "python", "-c", "import toml; print(toml.__file__, toml.WHERE)")
	if err != nil || strings.TrimSpace(out) != "/work/src/toml/__init__.py episode" {
		t.Fatalf("import toml: %v\n%s", err, out)
	}
	out, err = inSandbox(t, e, tree, "/bin/sh", "-c", "pytest -q -p no:cacheprovider tests")
	if err != nil || !strings.Contains(out, "2 passed") {
		t.Fatalf("pytest: %v\n%s", err, out)
	}
	// Debian's own toml is still what /usr/bin/python3 sees: the venv did
	// not change the host.
	host, err := exec.Command(debianPython, "-c", "import toml; print(toml.__file__)").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(host), debianSite) {
		t.Fatalf("host python's toml: %v %s", err, host)
	}

	start = time.Now()
	e2, err := Ensure(context.Background(), cache, req, log)
	if err != nil {
		t.Fatal(err)
	}
	if !e2.Cached || e2.BuildS != 0 || e2.Dir != e.Dir || e2.Key != e.Key {
		t.Fatalf("second Ensure: %+v", e2)
	}
	t.Logf("build %.1fs (Ensure %.1fs), cached Ensure %s", e.BuildS, first.Seconds(), time.Since(start))
	noLeftovers(t, cache)
}

// flatSix is a setup.py-only flat-layout project named six, as Debian's
// python3-six (a module, six.py, in dist-packages).
var flatSix = map[string]string{
	// setup.py writes a file into the package, as setuptools-scm writes a
	// version file: Env.Generated and Overlay carry it to a work tree.
	"setup.py": `import os
from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "six", "_built.py"), "w") as f:
    f.write("BUILT = True\n")
setup(name="six", version="0.0.1", packages=["six"])
`,
	".gitignore":      "six/_built.py\n",
	"six/__init__.py": "from six._built import BUILT\n\nWHERE = 'work'\n",
	"tests/test_six.py": `import six


def test_work_tree_first():
    assert six.__file__ == "/work/six/__init__.py", six.__file__
    assert six.WHERE == "work"
`,
}

// A flat-layout setup.py project shadows Debian's package of the same name
// in the sandbox (pytest's console script puts /work/tests, not /work, on
// sys.path, so the .pth entry does it); removing the ready marker, as a
// crash mid-build would leave things, makes the next Ensure rebuild.
func TestFlatLayoutSetupPyAndRebuild(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, flatSix)
	cache := t.TempDir()
	log, logged := newLog(t)
	req := Request{Repo: "example/six", Clone: repo, Commit: commit, Debian: with("python3-six")}
	e, err := Ensure(context.Background(), cache, req, log)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(e.Generated, " ") != "six/_built.py" {
		t.Fatalf("Generated: %v", e.Generated)
	}
	tree := workTree(t, repo, commit)
	if out, err := inSandbox(t, e, tree, "python", "-c", "import six"); err == nil || !strings.Contains(out, "six._built") {
		t.Fatalf("import six without the generated file: %v\n%s", err, out)
	}
	if laid, err := e.Overlay(tree); err != nil || strings.Join(laid, " ") != "six/_built.py" {
		t.Fatalf("Overlay: %v, %v", laid, err)
	}
	if laid, err := e.Overlay(tree); err != nil || len(laid) != 0 {
		t.Fatalf("second Overlay: %v, %v", laid, err)
	}
	check := func(e *Env) {
		t.Helper()
		out, err := inSandbox(t, e, tree, "python", "-c", "import six; print(six.__file__)")
		if err != nil || strings.TrimSpace(out) != "/work/six/__init__.py" {
			t.Fatalf("import six: %v\n%s", err, out)
		}
		// From elsewhere than /work, where the cwd is not on sys.path.
		out, err = inSandbox(t, e, tree, "/bin/sh", "-c", "cd / && python -c 'import six; print(six.__file__)' && cd /work && pytest -q -p no:cacheprovider tests")
		if err != nil || !strings.HasPrefix(out, "/work/six/__init__.py\n") || !strings.Contains(out, "1 passed") {
			t.Fatalf("six from /: %v\n%s", err, out)
		}
		// sys.path: the venv, the work tree, then the view of Debian's
		// packages.
		out, err = inSandbox(t, e, tree, "/bin/sh", "-c", "cd / && python -c 'import json, sys; print(json.dumps(sys.path))'")
		var path []string
		if err != nil || json.Unmarshal([]byte(out), &path) != nil {
			t.Fatalf("sys.path: %v\n%s", err, out)
		}
		order := []string{filepath.Join(e.SandboxDir, "lib", "python"+majorMinor(e.Python), "site-packages"), "/work", filepath.Join(SandboxRoot, e.Key, "debian", "usr_lib_python3_dist-packages")}
		at := -1
		for _, want := range order {
			i := indexOf(path, want)
			if i <= at {
				t.Fatalf("sys.path %v: want %v in this order", path, order)
			}
			at = i
		}
		// Debian's toml (installed: TestSrcLayoutPyproject needs it) is not
		// among this environment's packages, so it is not importable.
		out, err = inSandbox(t, e, tree, "python", "-c", "import toml")
		if err == nil || !strings.Contains(out, "No module named 'toml'") {
			t.Fatalf("a Debian package not asked for is importable: %v\n%s", err, out)
		}
	}
	check(e)

	// A crash mid-build: no ready marker, junk left in the environment's
	// directory and a temporary build directory.
	if err := os.Remove(filepath.Join(cache, e.Key, "ready")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cache, e.Key, "junk"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(cache, e.Key+".build-123"), 0o755); err != nil {
		t.Fatal(err)
	}
	e2, err := Ensure(context.Background(), cache, req, log)
	if err != nil {
		t.Fatal(err)
	}
	if e2.Cached || e2.Key != e.Key {
		t.Fatalf("Ensure after the marker's removal: %+v", e2)
	}
	if _, err := os.Stat(filepath.Join(cache, e.Key, "junk")); !os.IsNotExist(err) {
		t.Fatalf("the half-built directory was not removed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(cache, e.Key, "ready")); err != nil {
		t.Fatal(err)
	}
	if logged.count("half-built") != 1 || logged.count("pyenv: building") != 2 {
		t.Fatalf("logs:\n%s", logged.b.String())
	}
	check(e2)
	noLeftovers(t, cache)
}

// helperEnv, when set, makes TestHelperEnsure the Ensure of another
// process: "cacheDir\nclone\ncommit".
const helperEnv = "STASIS_PYENV_HELPER"

func TestHelperEnsure(t *testing.T) {
	v := os.Getenv(helperEnv)
	if v == "" {
		t.Skip("a helper for TestConcurrentEnsure")
	}
	f := strings.Split(v, "\n")
	e, err := Ensure(context.Background(), f[0], Request{Repo: "example/six", Clone: f[1], Commit: f[2], Debian: with("python3-six")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(e)
	fmt.Printf("ENV %s\n", b)
}

// Two processes and three goroutines asking for one environment at once
// build it once.
func TestConcurrentEnsure(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, flatSix)
	cache := t.TempDir()
	log, logged := newLog(t)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var envs []*Env
	var errs []error
	add := func(e *Env, err error) {
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			errs = append(errs, err)
			return
		}
		envs = append(envs, e)
	}
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperEnsure$", "-test.count=1")
			cmd.Env = append(os.Environ(), helperEnv+"="+cache+"\n"+repo+"\n"+commit)
			out, err := cmd.CombinedOutput()
			if err != nil {
				add(nil, fmt.Errorf("helper: %v\n%s", err, out))
				return
			}
			for _, l := range strings.Split(string(out), "\n") {
				if j, ok := strings.CutPrefix(l, "ENV "); ok {
					var e Env
					if err := json.Unmarshal([]byte(j), &e); err != nil {
						add(nil, err)
						return
					}
					add(&e, nil)
					return
				}
			}
			add(nil, fmt.Errorf("helper printed no environment:\n%s", out))
		}()
	}
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			add(Ensure(context.Background(), cache, Request{Repo: "example/six", Clone: repo, Commit: commit, Debian: with("python3-six")}, log))
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
	built := 0
	for _, e := range envs {
		if !e.Cached {
			built++
		}
		if e.Key != envs[0].Key || e.Dir != envs[0].Dir {
			t.Fatalf("different environments: %+v, %+v", e, envs[0])
		}
	}
	if len(envs) != 5 || built != 1 {
		t.Fatalf("%d environments, %d built (want 5, 1); logs:\n%s", len(envs), built, logged.b.String())
	}
	if n := logged.count("half-built"); n != 0 {
		t.Fatalf("a build removed another's work:\n%s", logged.b.String())
	}
	noLeftovers(t, cache)
}

// A Debian package that is not installed fails Ensure before anything is
// built, with the apt-get line that installs it.
func TestMissingPackage(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, flatSix)
	cache := t.TempDir()
	_, err := Ensure(context.Background(), cache, Request{Repo: "example/six", Clone: repo, Commit: commit,
		Debian: with("python3-stasis-no-such-package")}, nil)
	var me *MissingError
	if !errors.As(err, &me) {
		t.Fatalf("Ensure: %v, want a MissingError", err)
	}
	if want := "apt-get install -y python3-stasis-no-such-package"; me.InstallLine() != want || !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q, install line %q; want %q", err, me.InstallLine(), want)
	}
	if ents, _ := os.ReadDir(cache); len(ents) != 0 {
		t.Fatalf("the cache directory is not empty: %v", ents)
	}
	m, err := Missing([]string{"python3", "python3-stasis-no-such-package", "python3-stasis-other"})
	if err != nil || strings.Join(m, " ") != "python3-stasis-no-such-package python3-stasis-other" {
		t.Fatalf("Missing: %v, %v", m, err)
	}
}

// A build backend Debian does not have fails the build at the backend step,
// naming the backend; nothing is left behind.
func TestMissingBackend(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, map[string]string{
		"pyproject.toml": "[build-system]\nrequires = [\"stasis-no-such-backend\"]\nbuild-backend = \"stasis_no_such_backend.api\"\n\n[project]\nname = \"x\"\nversion = \"1\"\n",
		"x/__init__.py":  "",
	})
	cache := t.TempDir()
	_, err := Ensure(context.Background(), cache, Request{Repo: "example/x", Clone: repo, Commit: commit}, nil)
	var be *BuildError
	if !errors.As(err, &be) || be.Step != "backend" || !strings.Contains(err.Error(), "stasis_no_such_backend.api") ||
		!strings.Contains(err.Error(), "example/x at "+commit[:12]) {
		t.Fatalf("Ensure: %v", err)
	}
	t.Log(err)
	m, _ := filepath.Glob(filepath.Join(cache, "example__x-*"))
	for _, p := range m {
		if !strings.HasSuffix(p, ".log") && !strings.HasSuffix(p, ".lock") {
			t.Errorf("left in the cache: %s (want only the build's log and lock)", p)
		}
	}
	noLeftovers(t, cache)
}

// A setup.py that fails fails the build at the install step (PEP 660, then
// setup.py develop), with its output's last lines; nothing is left behind.
func TestInstallFails(t *testing.T) {
	requireTools(t)
	repo, commit := makeRepo(t, map[string]string{
		"setup.py":      "raise SystemExit('stasis: this setup.py is broken')\n",
		"x/__init__.py": "",
	})
	cache := t.TempDir()
	log, _ := newLog(t)
	_, err := Ensure(context.Background(), cache, Request{Repo: "example/x", Clone: repo, Commit: commit}, log)
	var be *BuildError
	t.Log(err)
	if !errors.As(err, &be) || !strings.HasPrefix(be.Step, "install") || !strings.Contains(be.Tail, "this setup.py is broken") {
		t.Fatalf("Ensure: %v", err)
	}
	if m, _ := filepath.Glob(filepath.Join(cache, "example__x-*[0-9a-f]")); len(m) != 0 {
		t.Fatalf("left in the cache: %v", m)
	}
	noLeftovers(t, cache)
}

// An unknown commit and a cache under /work are refused.
func TestBadRequests(t *testing.T) {
	requireTools(t)
	repo, _ := makeRepo(t, flatSix)
	_, err := Ensure(context.Background(), t.TempDir(), Request{Repo: "example/six", Clone: repo, Commit: "0123456789abcdef0123456789abcdef01234567"}, nil)
	if err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("unknown commit: %v", err)
	}
	_, err = Ensure(context.Background(), "/work/cache", Request{Repo: "example/six", Clone: repo, Commit: "HEAD"}, nil)
	if err == nil || !strings.Contains(err.Error(), "/work") {
		t.Fatalf("cache under /work: %v", err)
	}
}

// Packages: every SWE-bench repository has the pytest set and its own
// packages; an unknown one the pytest set alone; the table's names are
// Debian's (checked with apt-cache where the package lists are there).
func TestPackages(t *testing.T) {
	base := Packages("someone/else")
	if strings.Join(base, " ") != strings.Join(normalize(pytestSet), " ") {
		t.Fatalf("default: %v", base)
	}
	for repo := range repoPackages {
		p := Packages(strings.ToUpper(repo))
		if len(p) <= len(base) || !contains(p, "python3-pytest") || !contains(p, "python3-setuptools") {
			t.Errorf("%s: %v", repo, p)
		}
	}
	if !contains(Packages("pytest-dev/pytest"), "python3-setuptools-scm") || !contains(Packages("pallets/flask"), "flit") {
		t.Error("build backends missing from the table")
	}
	if _, err := exec.LookPath("apt-cache"); err != nil {
		t.Skip("no apt-cache")
	}
	var all []string
	for _, pkgs := range repoPackages {
		all = append(all, pkgs...)
	}
	all = normalize(append(all, pytestSet...))
	out, _ := exec.Command("apt-cache", append([]string{"show", "--no-all-versions"}, all...)...).CombinedOutput()
	if bytes.Contains(out, []byte("No packages found")) && !bytes.Contains(out, []byte("Package: python3\n")) {
		t.Skip("apt-cache has no package lists (apt-get update)")
	}
	for _, p := range all {
		if !bytes.Contains(out, []byte("Package: "+p+"\n")) {
			t.Errorf("apt-cache knows no package %s", p)
		}
	}
}

func indexOf(list []string, s string) int {
	for i, x := range list {
		if x == s {
			return i
		}
	}
	return -1
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestRealRepository builds the environment of a real repository when
// STASIS_PYENV_REPO (owner/name), STASIS_PYENV_CLONE and STASIS_PYENV_COMMIT
// are set, and runs STASIS_PYENV_TEST (a shell command) in a work tree at
// the commit; STASIS_PYENV_CACHE keeps the environment.
func TestRealRepository(t *testing.T) {
	repo, clone, commit := os.Getenv("STASIS_PYENV_REPO"), os.Getenv("STASIS_PYENV_CLONE"), os.Getenv("STASIS_PYENV_COMMIT")
	if repo == "" || clone == "" || commit == "" {
		t.Skip("STASIS_PYENV_REPO, STASIS_PYENV_CLONE and STASIS_PYENV_COMMIT are not set")
	}
	requireTools(t)
	cache := os.Getenv("STASIS_PYENV_CACHE")
	if cache == "" {
		cache = t.TempDir()
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	e, err := Ensure(context.Background(), cache, Request{Repo: repo, Clone: clone, Commit: commit}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", e)
	if cmd := os.Getenv("STASIS_PYENV_TEST"); cmd != "" {
		tree := filepath.Join(t.TempDir(), "tree")
		c := exec.Command("git", "-c", "safe.directory=*", "clone", "-q", "--no-checkout", clone, tree)
		c.Env = gitEnv()
		if out, err := c.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		git(t, tree, "checkout", "-q", "--detach", e.Commit)
		laid, err := e.Overlay(tree)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("laid into the work tree: %v", laid)
		out, err := inSandbox(t, e, tree, "/bin/sh", "-c", cmd)
		t.Logf("%s", out)
		if err != nil {
			t.Fatal(err)
		}
	}
}
