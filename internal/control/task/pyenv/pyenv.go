// Package pyenv owns the Python environments of repository tasks: one
// virtual environment per repository and commit, built from Debian's
// packages (no package index is used), cached on disk and built once however
// many callers ask for it at the same time.
//
// An environment is a venv made by Debian's /usr/bin/python3 whose
// site-packages holds the repository itself, installed in development
// (editable) mode pointing at /work, where every sandbox has its work tree,
// and a .pth file that appends Debian's packages to sys.path: a view of
// /usr/lib/python3/dist-packages (symbolic links) that holds the requested
// packages and their dependencies only, so that another repository's
// packages installed on the same host (pytest plugins above all, which
// pytest loads whenever it can import them) stay out. The editable install
// is made in compat mode, a plain sys.path entry (/work, or /work/src for a
// src layout), and site-packages processes its .pth files in name order,
// Debian's last, so at test time the repository's own packages come before
// any Debian package of the same name (the pytest repository's _pytest
// before python3-pytest's, flask's src/flask before python3-flask's).
//
// Under the cache directory, KEY/ holds venv/, debian/ (the view),
// generated/ (see Env.Generated), env.json and, written last, ready;
// KEY.lock and KEY.log (the last build's output) lie beside it.
//
// The cache directory must be visible, at the same path, in the sandboxes
// that run the tests: not under /work, /tmp or the sandbox's home, which a
// sandbox mounts afresh.
package pyenv

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"stasis/internal/bwrap"
	"stasis/internal/flock"
	"stasis/internal/storage/atomicfile"
)

// builderVersion is part of every Key: a change to how environments are
// built changes it, so environments built the old way are not reused.
const builderVersion = "pyenv-2"

// SandboxRoot is where sandboxes see the environments' cache directory: a
// provider binds it there read-only (local.Options.ReadOnlyBinds). A venv
// holds absolute paths (its scripts' first lines, its .pth files), so each
// is built as it is seen from inside, SandboxRoot/KEY/venv, whatever the
// cache's path on the host.
const SandboxRoot = "/stasis-envs"

// defaultPath is the PATH Vars builds on when given none (task.SandboxPath's
// base, without the Go toolchain it may add).
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// debianPython is the interpreter every venv is made from.
const debianPython = "/usr/bin/python3"

// debianSite is the directory of Debian's Python packages.
const debianSite = "/usr/lib/python3/dist-packages"

// debianPth is the name of the .pth file that appends Debian's packages to
// a venv's sys.path. site processes .pth files in sorted name order, so
// this one, last, appends after the editable install's entries.
const debianPth = "zzz-stasis-debian-dist-packages.pth"

// Request names the environment one repository at one commit needs.
type Request struct {
	Repo   string   // "owner/name"
	Clone  string   // host path of a git repository (clone or bundle-cloned) that holds Commit
	Commit string   // the environment_setup_commit (or base_commit)
	Debian []string // Debian packages the environment needs; nil: Packages(Repo)
}

// Env is a built environment.
type Env struct {
	Key string // stable: repo, commit, package list and versions, Python version, builder version
	Dir string // absolute host path of the venv
	// SandboxDir is the venv's path inside a sandbox that binds the cache
	// directory at SandboxRoot (and inside the build): SandboxRoot/KEY/venv.
	SandboxDir string
	Python     string  // e.g. "3.11.2"
	Cached     bool    // true when it was already built
	BuildS     float64 // seconds this call spent building (0 when cached)

	Repo     string   // as requested
	Commit   string   // the full commit hash the environment was built at
	Packages []string // the Debian packages it was built with (sorted)
	// Debian lists, as name=version, the installed packages the
	// environment sees: Packages and their dependencies.
	Debian []string
	// Editable says how the repository is installed: "pep660" (a PEP 660
	// editable wheel, in setuptools' compat mode: a .pth entry for /work or
	// /work/src) or "develop" (pip's legacy setup.py develop, for a setup.py
	// project that PEP 660 could not build; its metadata, NAME.egg-info, is
	// then among Generated).
	Editable string
	// Generated lists the files, relative to the work tree, that the
	// editable install made in the checkout and git does not track: compiled
	// extensions, version files written by setuptools-scm, a develop
	// install's .egg-info. An episode's work tree lacks them; copies are
	// under GeneratedDir, for a harness to lay into the tree where absent.
	Generated    []string
	GeneratedDir string
}

// Vars returns what an exec in a sandbox adds to its environment to use the
// venv: VIRTUAL_ENV, and PATH with the venv's bin first, then basePath
// (defaultPath when empty).
func (e *Env) Vars(basePath string) map[string]string {
	if basePath == "" {
		basePath = defaultPath
	}
	return map[string]string{
		"VIRTUAL_ENV": e.SandboxDir,
		"PATH":        filepath.Join(e.SandboxDir, "bin") + ":" + basePath,
	}
}

// Overlay copies the Generated files into the work tree tree (the host path
// of what a sandbox sees at /work) where the tree does not have them, and
// returns those it copied. A harness calls it on an episode's fresh work
// tree: without them, a repository whose code imports a file its build
// writes (pytest's src/_pytest/_version.py, compiled extensions) fails at
// import. Most repositories' .gitignore lists such files.
func (e *Env) Overlay(tree string) ([]string, error) {
	var laid []string
	for _, rel := range e.Generated {
		if !filepath.IsLocal(rel) {
			return laid, fmt.Errorf("pyenv: generated file %q is not a local path", rel)
		}
		dst := filepath.Join(tree, rel)
		if _, err := os.Lstat(dst); err == nil {
			continue
		}
		src := filepath.Join(e.GeneratedDir, rel)
		fi, err := os.Lstat(src)
		if err != nil {
			return laid, fmt.Errorf("pyenv: environment %s: %w", e.Key, err)
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return laid, err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			t, err := os.Readlink(src)
			if err == nil {
				err = os.Symlink(t, dst)
			}
			if err != nil {
				return laid, err
			}
		} else if err := copyFile(src, dst, fi.Mode().Perm()); err != nil {
			return laid, err
		}
		laid = append(laid, rel)
	}
	return laid, nil
}

// BuildError is a failed build step.
type BuildError struct {
	Repo, Commit string
	Step         string // "checkout", "venv", "backend", "install", "verify", ...
	Err          error
	Tail         string // the step's last output lines
	Log          string // the whole build's log
}

func (e *BuildError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pyenv: %s at %s: %s: %v", e.Repo, short(e.Commit), e.Step, e.Err)
	if e.Tail != "" {
		fmt.Fprintf(&b, "\n--- last output ---\n%s", e.Tail)
	}
	if e.Log != "" {
		fmt.Fprintf(&b, "\n(the build's log: %s)", e.Log)
	}
	return b.String()
}

func (e *BuildError) Unwrap() error { return e.Err }

// MissingError says which Debian packages an environment needs that are not
// installed.
type MissingError struct {
	Repo     string
	Packages []string
}

func (e *MissingError) Error() string {
	return fmt.Sprintf("pyenv: the environment of %s needs Debian packages that are not installed: %s; install them with: %s",
		e.Repo, strings.Join(e.Packages, " "), installLine(e.Packages))
}

// InstallLine is the apt-get command that installs the missing packages.
func (e *MissingError) InstallLine() string { return installLine(e.Packages) }

// Ensure returns the environment r names, building it under cacheDir if no
// complete one is there. A build that a crash cut short leaves no ready
// marker; the next Ensure removes what it left and builds again. Callers in
// any number of processes may ask for the same environment at once: one
// builds it, the others wait for it (or for ctx) and use it.
func Ensure(ctx context.Context, cacheDir string, r Request, log *slog.Logger) (*Env, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if r.Repo == "" || r.Clone == "" || r.Commit == "" {
		return nil, fmt.Errorf("pyenv: a request needs Repo, Clone and Commit (have %q, %q, %q)", r.Repo, r.Clone, r.Commit)
	}
	cacheDir, err := filepath.Abs(cacheDir)
	if err != nil {
		return nil, err
	}
	if under(cacheDir, "/work") {
		return nil, fmt.Errorf("pyenv: cache directory %s is under /work, which the build and every sandbox mount over", cacheDir)
	}
	pkgs := r.Debian
	if pkgs == nil {
		pkgs = Packages(r.Repo)
	}
	pkgs = normalize(append(append([]string{}, pkgs...), builderPackages...))
	// bubblewrap and git are the builder's tools, not the environment's:
	// they are checked but not part of the Key.
	missing, err := Missing(append(append([]string{}, pkgs...), "bubblewrap", "git"))
	if err != nil {
		return nil, err
	}
	if len(missing) > 0 {
		return nil, &MissingError{Repo: r.Repo, Packages: missing}
	}
	py, err := pythonVersion()
	if err != nil {
		return nil, err
	}
	installed, provides, err := installedPackages()
	if err != nil {
		return nil, err
	}
	deps := closure(pkgs, installed, provides)
	commit, err := resolveCommit(ctx, r.Clone, r.Commit)
	if err != nil {
		return nil, fmt.Errorf("pyenv: %s: commit %s in %s: %w", r.Repo, r.Commit, r.Clone, err)
	}
	key := cacheKey(r.Repo, commit, py, pkgs, versions(deps))
	keyDir := filepath.Join(cacheDir, key)
	if e, err := load(keyDir); err == nil {
		log.Debug("pyenv: cached", "repo", r.Repo, "commit", short(commit), "key", key)
		return e, nil
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, err
	}
	unlock, err := lockCtx(ctx, filepath.Join(cacheDir, key+".lock"))
	if err != nil {
		return nil, err
	}
	defer unlock()
	if e, err := load(keyDir); err == nil {
		return e, nil // another caller built it while this one waited
	}
	b := &builder{
		log: log, repo: r.Repo, clone: r.Clone, commit: commit, pkgs: pkgs, deps: deps, python: py,
		cacheDir: cacheDir, key: key, keyDir: keyDir,
	}
	return b.build(ctx)
}

// cacheKey is the cache key of an environment: readable (repository,
// commit) and a hash of everything the environment depends on: the Debian
// packages asked for and the installed versions of them and their
// dependencies (an upgrade of Debian's numpy, say, makes a new environment,
// as extensions built against the old one may not load).
func cacheKey(repo, commit, python string, pkgs, debian []string) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00%s\x00%s\x00", builderVersion, strings.ToLower(repo), commit, python)
	for _, p := range normalize(pkgs) {
		fmt.Fprintf(h, "%s\x00", p)
	}
	fmt.Fprintf(h, "\x00")
	for _, p := range debian {
		fmt.Fprintf(h, "%s\x00", p)
	}
	name := unsafeName.ReplaceAllString(strings.ReplaceAll(repo, "/", "__"), "_")
	return name + "-" + short(commit) + "-" + hex.EncodeToString(h.Sum(nil))[:16]
}

var unsafeName = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

// load returns the environment in keyDir if its ready marker is there.
func load(keyDir string) (*Env, error) {
	if _, err := os.Stat(filepath.Join(keyDir, "ready")); err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(keyDir, "env.json"))
	if err != nil {
		return nil, err
	}
	var e Env
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, fmt.Errorf("pyenv: %s: %w", filepath.Join(keyDir, "env.json"), err)
	}
	e.Cached, e.BuildS = true, 0
	return &e, nil
}

// lockCtx takes the exclusive lock at path, giving up when ctx ends (the
// lock, if it comes later, is then released at once).
func lockCtx(ctx context.Context, path string) (func(), error) {
	type res struct {
		unlock func()
		err    error
	}
	ch := make(chan res, 1)
	go func() {
		u, err := flock.Lock(path, true)
		ch <- res{u, err}
	}()
	select {
	case r := <-ch:
		return r.unlock, r.err
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.unlock != nil {
				r.unlock()
			}
		}()
		return nil, fmt.Errorf("pyenv: waiting for %s: %w", path, ctx.Err())
	}
}

var pythonVersion = sync.OnceValues(func() (string, error) {
	out, err := exec.Command(debianPython, "-c", "import platform; print(platform.python_version())").Output()
	if err != nil {
		return "", fmt.Errorf("pyenv: %s: %w", debianPython, err)
	}
	return strings.TrimSpace(string(out)), nil
})

// resolveCommit returns the full hash of commit in the repository clone.
func resolveCommit(ctx context.Context, clone, commit string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", "-c", "safe.directory=*", "-C", clone, "rev-parse", "--verify", "--quiet", commit+"^{commit}")
	cmd.Env = gitEnv()
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("not found (git rev-parse: %v)", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// gitEnv is the environment git runs with: the host's, less what would
// point it at another repository.
func gitEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GIT_") {
			env = append(env, kv)
		}
	}
	return env
}

// builder builds one environment, holding its lock.
type builder struct {
	log                   *slog.Logger
	repo, clone, commit   string
	pkgs                  []string
	deps                  []*dpkgPkg
	views                 []string // as the venv sees them (inside)
	python                string
	cacheDir, key, keyDir string
	venv, tmp, checkout   string
	logFile               *os.File
	logPath               string
	buildEnv              []string
	backend               backendInfo
	editable              string
	generated             []string
}

func (b *builder) build(ctx context.Context) (env *Env, err error) {
	start := time.Now()
	b.venv = filepath.Join(b.keyDir, "venv")
	venvIn := b.inside(b.venv)
	if _, err := os.Stat(b.keyDir); err == nil {
		b.log.Warn("pyenv: removing a half-built environment", "repo", b.repo, "commit", short(b.commit), "dir", b.keyDir)
	}
	if err := os.RemoveAll(b.keyDir); err != nil {
		return nil, err
	}
	stale, _ := filepath.Glob(filepath.Join(b.cacheDir, b.key+".build-*"))
	for _, s := range stale {
		_ = os.RemoveAll(s)
	}
	if err := os.MkdirAll(b.keyDir, 0o755); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(b.keyDir)
		}
	}()
	b.tmp, err = os.MkdirTemp(b.cacheDir, b.key+".build-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(b.tmp)
	b.checkout = filepath.Join(b.tmp, "checkout")
	for _, d := range []string{"home", "tmp"} {
		if err := os.Mkdir(filepath.Join(b.tmp, d), 0o755); err != nil {
			return nil, err
		}
	}
	b.logPath = filepath.Join(b.cacheDir, b.key+".log")
	if b.logFile, err = os.Create(b.logPath); err != nil {
		return nil, err
	}
	defer b.logFile.Close()
	b.buildEnv = []string{
		"PATH=" + filepath.Join(venvIn, "bin") + ":/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=" + filepath.Join(b.tmp, "home"),
		"TMPDIR=" + filepath.Join(b.tmp, "tmp"),
		"LANG=C.UTF-8",
		"VIRTUAL_ENV=" + venvIn,
		"PIP_CONFIG_FILE=/dev/null",
		"PIP_NO_INPUT=1",
		"PIP_DISABLE_PIP_VERSION_CHECK=1",
		"PYTHONNOUSERSITE=1",
		"PYTHONDONTWRITEBYTECODE=1",
	}
	b.log.Info("pyenv: building", "repo", b.repo, "commit", short(b.commit), "key", b.key, "packages", len(b.pkgs))
	if err := b.runSteps(ctx); err != nil {
		return nil, err
	}
	env = &Env{
		Key: b.key, Dir: b.venv, SandboxDir: venvIn, Python: b.python, Repo: b.repo, Commit: b.commit, Packages: b.pkgs, Debian: versions(b.deps),
		Editable: b.editable, Generated: b.generated, GeneratedDir: filepath.Join(b.keyDir, "generated"),
		BuildS: time.Since(start).Seconds(),
	}
	if err := b.publish(env); err != nil {
		return nil, err
	}
	b.log.Info("pyenv: built", "repo", b.repo, "commit", short(b.commit), "key", b.key, "editable", b.editable, "seconds", round(env.BuildS))
	return env, nil
}

// runSteps builds the environment step by step, each step's output in
// the log under its name; a failure is a BuildError naming the step.
func (b *builder) runSteps(ctx context.Context) error {
	steps := []struct {
		name string
		f    func(context.Context) error
	}{
		{"checkout", b.doCheckout},
		{"venv", b.makeVenv},
		{"backend", b.checkBackend},
		{"install", b.install},
		{"verify", b.verify},
		{"scripts", b.debianScripts},
		{"generated", b.collectGenerated},
	}
	for _, s := range steps {
		fmt.Fprintf(b.logFile, "=== %s\n", s.name)
		if err := s.f(ctx); err != nil {
			var be *BuildError
			if !errors.As(err, &be) {
				err = &BuildError{Repo: b.repo, Commit: b.commit, Step: s.name, Err: err, Log: b.logPath}
			}
			b.log.Error("pyenv: build failed", "repo", b.repo, "commit", short(b.commit), "step", s.name, "err", err)
			return err
		}
	}
	return nil
}

// publish writes env.json and, once everything the venv holds is durable,
// the ready marker.
func (b *builder) publish(env *Env) error {
	if err := atomicfile.WriteJSON(filepath.Join(b.keyDir, "env.json"), env, 0o644); err != nil {
		return err
	}
	// Everything the venv holds is durable before the marker says so.
	if err := atomicfile.SyncFS(b.keyDir); err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(b.keyDir, "ready"), []byte(b.key+"\n"), 0o644)
}

// doCheckout makes a checkout of the commit: sharing the clone's objects,
// unless the clone is under /work, where the build's sandbox would hide them.
func (b *builder) doCheckout(ctx context.Context) error {
	args := []string{"-c", "safe.directory=*", "clone", "--quiet", "--no-checkout"}
	if under(mustAbs(b.clone), "/work") {
		args = append(args, "--local")
	} else {
		args = append(args, "--shared")
	}
	if _, err := b.run(ctx, "checkout", gitEnv(), "", "git", append(args, b.clone, b.checkout)...); err != nil {
		return err
	}
	_, err := b.run(ctx, "checkout", gitEnv(), "", "git", "-C", b.checkout, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", b.commit)
	return err
}

// makeVenv makes the venv, without pip (Debian's is used), the view of
// Debian's packages, and the .pth file that appends the view after
// everything else.
func (b *builder) makeVenv(ctx context.Context) error {
	if _, err := b.run(ctx, "venv", b.buildEnv, "/", debianPython, "-m", "venv", "--without-pip", b.inside(b.venv)); err != nil {
		return err
	}
	site, err := b.sitePackages()
	if err != nil {
		return err
	}
	dirs := []string{debianSite}
	if mm := majorMinor(b.python); mm != "" {
		if d := "/usr/lib/python" + mm + "/dist-packages"; isDir(d) {
			dirs = append(dirs, d)
		}
	}
	var line strings.Builder
	line.WriteString("import site")
	for _, d := range dirs {
		owned, err := ownedUnder(b.deps, d)
		if err != nil {
			return err
		}
		view := filepath.Join(b.keyDir, "debian", strings.TrimPrefix(strings.ReplaceAll(d, "/", "_"), "_"))
		if err := makeView(view, d, owned); err != nil {
			return fmt.Errorf("making the view of %s: %w", d, err)
		}
		b.views = append(b.views, b.inside(view))
		fmt.Fprintf(&line, "; site.addsitedir(%q)", b.inside(view))
	}
	line.WriteString("\n")
	return os.WriteFile(filepath.Join(site, debianPth), []byte(line.String()), 0o644)
}

func (b *builder) sitePackages() (string, error) {
	mm := majorMinor(b.python)
	site := filepath.Join(b.venv, "lib", "python"+mm, "site-packages")
	if !isDir(site) {
		return "", fmt.Errorf("no site-packages at %s", site)
	}
	return site, nil
}

// backendInfo is what backendScript reports about the project's build.
type backendInfo struct {
	Backend     string   `json:"backend"`
	Requires    []string `json:"requires"`
	SetupPy     bool     `json:"setup_py"`
	Pyproject   bool     `json:"pyproject"`
	ImportError string   `json:"import_error"`
	Unmet       []string `json:"unmet"`
	Error       string   `json:"error"`
}

// backendScript reads pyproject.toml's [build-system], imports the build
// backend as pip would, and lists the build requirements that the
// installed distributions do not meet.
const backendScript = `
import importlib, importlib.metadata as md, json, os, sys
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
out = {"backend": "", "requires": [], "setup_py": os.path.exists("setup.py"),
       "pyproject": os.path.exists("pyproject.toml"), "import_error": "", "unmet": [], "error": ""}
bs = {}
if out["pyproject"]:
    import tomllib
    try:
        with open("pyproject.toml", "rb") as f:
            bs = tomllib.load(f).get("build-system", {})
    except Exception as e:
        out["error"] = "pyproject.toml: %s" % e
out["backend"] = bs.get("build-backend", "")
out["requires"] = list(bs.get("requires", []))
if not out["pyproject"] and not out["setup_py"]:
    out["error"] = "neither pyproject.toml nor setup.py at the top of the repository"
backend = out["backend"] or "setuptools.build_meta"
sys.path[:0] = [os.path.abspath(p) for p in bs.get("backend-path", [])]
try:
    importlib.import_module(backend.split(":")[0])
except Exception as e:
    out["import_error"] = "%s: %s" % (type(e).__name__, e)
from pip._vendor.packaging.requirements import Requirement
for r in out["requires"]:
    try:
        req = Requirement(r)
    except Exception as e:
        out["unmet"].append("%s (cannot parse: %s)" % (r, e))
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        v = md.version(req.name)
    except md.PackageNotFoundError:
        out["unmet"].append("%s (not installed)" % r)
        continue
    if req.specifier and not req.specifier.contains(v, prereleases=True):
        out["unmet"].append("%s (Debian's is %s)" % (r, v))
print(json.dumps(out))
`

// backendDebian names the Debian package of a build backend's top-level
// module.
var backendDebian = map[string]string{
	"setuptools":        "python3-setuptools",
	"flit_core":         "flit",
	"hatchling":         "python3-hatchling",
	"poetry":            "python3-poetry-core",
	"pdm":               "python3-pdm-pep517 (which has pdm.pep517; pdm.backend is not packaged in bookworm)",
	"mesonpy":           "python3-mesonpy",
	"scikit_build_core": "none in bookworm",
	"maturin":           "none in bookworm",
}

func (b *builder) checkBackend(ctx context.Context) error {
	out, err := b.run(ctx, "backend", b.buildEnv, "/work", filepath.Join(b.inside(b.venv), "bin", "python"), "-c", backendScript)
	if err != nil {
		return err
	}
	var info backendInfo
	if err := json.Unmarshal(lastLine(out), &info); err != nil {
		return fmt.Errorf("reading the backend check's answer: %w", err)
	}
	b.backend = info
	if info.Error != "" {
		return errors.New(info.Error)
	}
	if info.ImportError != "" {
		name := info.Backend
		if name == "" {
			name = "setuptools.build_meta (the default for a setup.py project)"
		}
		mod, _, _ := strings.Cut(strings.Split(info.Backend, ":")[0], ".")
		if mod == "" {
			mod = "setuptools"
		}
		deb := backendDebian[mod]
		hint := "no Debian package is known to provide it"
		if deb != "" {
			hint = "Debian package: " + deb
		}
		err := fmt.Errorf("the build backend %s cannot be imported from Debian's packages (%s); %s", name, info.ImportError, hint)
		if len(info.Unmet) > 0 {
			err = fmt.Errorf("%w; build requirements Debian's packages do not meet: %s", err, strings.Join(info.Unmet, "; "))
		}
		return err
	}
	if len(info.Unmet) > 0 {
		b.log.Warn("pyenv: build requirements that Debian's packages do not meet", "repo", b.repo, "commit", short(b.commit), "unmet", info.Unmet)
	}
	return nil
}

// install installs the repository, checked out and bound at /work, in
// development mode: a PEP 660 editable wheel in setuptools' compat mode (a
// plain .pth entry, which Debian's packages cannot shadow); for a setup.py
// project with no build backend of its own that PEP 660 cannot build, pip's
// legacy setup.py develop.
func (b *builder) install(ctx context.Context) error {
	pip := []string{"-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir"}
	py := filepath.Join(b.inside(b.venv), "bin", "python")
	_, err := b.run(ctx, "install", b.buildEnv, "/work", py,
		append(pip, "--use-pep517", "--config-settings", "editable_mode=compat", "-e", "/work")...)
	if err == nil {
		b.editable = "pep660"
		return nil
	}
	if b.backend.SetupPy && b.backend.Backend == "" {
		b.log.Warn("pyenv: PEP 660 editable install failed; trying setup.py develop", "repo", b.repo, "commit", short(b.commit))
		_, err2 := b.run(ctx, "install (setup.py develop)", b.buildEnv, "/work", py, append(pip, "--no-use-pep517", "-e", "/work")...)
		if err2 == nil {
			b.editable = "develop"
			return nil
		}
		err = err2
	}
	if len(b.backend.Unmet) > 0 {
		var be *BuildError
		if errors.As(err, &be) {
			be.Err = fmt.Errorf("%w (build requirements Debian's packages do not meet: %s)", be.Err, strings.Join(b.backend.Unmet, "; "))
		}
	}
	return err
}

// verifyScript prints sys.path as the venv's Python sees it outside /work.
const verifyScript = `import json, sys; print(json.dumps(sys.path))`

// verify checks that the editable install put the work tree on sys.path
// before Debian's packages.
func (b *builder) verify(ctx context.Context) error {
	out, err := b.run(ctx, "verify", b.buildEnv, "/", filepath.Join(b.inside(b.venv), "bin", "python"), "-c", verifyScript)
	if err != nil {
		return err
	}
	var path []string
	if err := json.Unmarshal(lastLine(out), &path); err != nil {
		return fmt.Errorf("reading sys.path: %w", err)
	}
	work, deb := -1, -1
	for i, p := range path {
		if work < 0 && under(p, "/work") {
			work = i
		}
		if deb < 0 && p == b.views[0] {
			deb = i
		}
	}
	switch {
	case work < 0:
		return fmt.Errorf("the editable install put no /work entry on sys.path (an import-hook install, which Debian's packages of the same name would shadow?); sys.path: %v", path)
	case deb < 0:
		return fmt.Errorf("the view of Debian's packages, %s, is not on the venv's sys.path: %v", b.views[0], path)
	case deb < work:
		return fmt.Errorf("the view of Debian's packages comes before the work tree on sys.path: %v", path)
	}
	return nil
}

// debianScripts writes, into the venv's bin, a script for each console
// entry point of the requested Debian packages that the editable install
// did not make: Debian's own (/usr/bin/pytest-3 and the like) run
// /usr/bin/python3, outside the venv, where the repository is not found.
func (b *builder) debianScripts(ctx context.Context) error {
	out, err := b.run(ctx, "scripts", os.Environ(), "", "dpkg-query", append([]string{"-L", "--"}, b.pkgs...)...)
	if err != nil {
		return err
	}
	bin := filepath.Join(b.venv, "bin")
	py := filepath.Join(b.inside(b.venv), "bin", "python")
	var made []string
	for _, f := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(f, "/usr/lib/python3") || !strings.HasSuffix(f, "/entry_points.txt") {
			continue
		}
		eps, err := consoleScripts(f)
		if err != nil {
			return err
		}
		for _, ep := range eps {
			dst := filepath.Join(bin, ep.name)
			if _, err := os.Lstat(dst); err == nil {
				continue
			}
			if err := os.WriteFile(dst, []byte(ep.script(py)), 0o755); err != nil {
				return err
			}
			made = append(made, ep.name)
		}
	}
	sort.Strings(made)
	fmt.Fprintf(b.logFile, "scripts: %s\n", strings.Join(made, " "))
	return nil
}

type entryPoint struct{ name, module, attr string }

var scriptName = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.+-]*$`)

// consoleScripts reads the console_scripts of an entry_points.txt.
func consoleScripts(path string) ([]entryPoint, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var eps []entryPoint
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		if line[0] == '[' && strings.HasSuffix(line, "]") {
			section = strings.TrimSpace(line[1 : len(line)-1])
			continue
		}
		if section != "console_scripts" {
			continue
		}
		name, value, ok := strings.Cut(line, "=")
		if !ok {
			continue
		}
		name, value = strings.TrimSpace(name), strings.TrimSpace(value)
		if i := strings.Index(value, "["); i >= 0 { // extras
			value = strings.TrimSpace(value[:i])
		}
		mod, attr, _ := strings.Cut(value, ":")
		if !scriptName.MatchString(name) || mod == "" {
			continue
		}
		eps = append(eps, entryPoint{name, strings.TrimSpace(mod), strings.TrimSpace(attr)})
	}
	return eps, sc.Err()
}

func (ep entryPoint) script(python string) string {
	var attrs []string
	if ep.attr != "" {
		attrs = strings.Split(ep.attr, ".")
	}
	q, _ := json.Marshal(attrs)
	return fmt.Sprintf(`#!%s
# A Debian package's console script, run by the venv's Python (stasis/task/pyenv).
import sys
from importlib import import_module
if __name__ == "__main__":
    obj = import_module(%q)
    for a in %s:
        obj = getattr(obj, a)
    sys.exit(obj())
`, python, ep.module, q)
}

// collectGenerated copies the files the install made in the checkout that
// git does not track (build/, dist/, caches and, for a PEP 660 install,
// .egg-info aside) to the environment's generated directory.
func (b *builder) collectGenerated(ctx context.Context) error {
	out, err := b.run(ctx, "generated", gitEnv(), "", "git", "-c", "safe.directory=*", "-C", b.checkout, "ls-files", "-z", "--others")
	if err != nil {
		return err
	}
	dst := filepath.Join(b.keyDir, "generated")
	for _, rel := range strings.Split(string(out), "\x00") {
		if rel == "" || skipGenerated(rel, b.editable == "develop") {
			continue
		}
		src := filepath.Join(b.checkout, rel)
		fi, err := os.Lstat(src)
		if err != nil {
			return err
		}
		to := filepath.Join(dst, rel)
		if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
			return err
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := os.Readlink(src)
			if err != nil {
				return err
			}
			if err := os.Symlink(t, to); err != nil {
				return err
			}
		case fi.Mode().IsRegular():
			if err := copyFile(src, to, fi.Mode().Perm()); err != nil {
				return err
			}
		default:
			continue
		}
		b.generated = append(b.generated, rel)
	}
	return nil
}

func skipGenerated(rel string, keepEggInfo bool) bool {
	parts := strings.Split(rel, "/")
	switch parts[0] {
	case "build", "dist", ".eggs", ".tox", ".nox", ".pytest_cache", ".mypy_cache":
		return true
	}
	for _, p := range parts {
		if p == "__pycache__" || (strings.HasSuffix(p, ".egg-info") && !keepEggInfo) {
			return true
		}
	}
	return strings.HasSuffix(rel, ".pyc")
}

func copyFile(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// run runs one command of step, in the build's sandbox (the checkout bound
// at /work, cwd chdir) when chdir is set, else on the host. Its output goes
// to the build's log and is returned; a failure is a BuildError with the
// output's last lines.
func (b *builder) run(ctx context.Context, step string, env []string, chdir, name string, args ...string) ([]byte, error) {
	argv := append([]string{name}, args...)
	if chdir != "" {
		sb, err := sandboxArgs(b.checkout, chdir, [][2]string{{b.keyDir, b.inside(b.keyDir)}, {b.tmp, b.tmp}})
		if err != nil {
			return nil, err
		}
		argv = append(append([]string{"bwrap"}, sb...), argv...)
	}
	fmt.Fprintf(b.logFile, "$ %s\n", strings.Join(argv, " "))
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = env
	var out bytes.Buffer
	var errb tailBuffer
	cmd.Stdout = io.MultiWriter(&out, b.logFile)
	cmd.Stderr = io.MultiWriter(&errb, b.logFile)
	setGroup(cmd)
	start := time.Now()
	err := cmd.Run()
	fmt.Fprintf(b.logFile, "(%s, %.1fs, %v)\n", step, time.Since(start).Seconds(), err)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		combined := append(append([]byte{}, out.Bytes()...), errb.Bytes()...)
		return out.Bytes(), &BuildError{Repo: b.repo, Commit: b.commit, Step: step, Err: err, Tail: tail(combined, 25), Log: b.logPath}
	}
	return out.Bytes(), nil
}

// setGroup runs cmd in a process group of its own, and kills the whole
// group when its context ends.
func setGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
}

// inside is where a path under the environment's directory is seen from
// inside the build and the sandboxes (SandboxRoot/KEY/...).
func (b *builder) inside(p string) string {
	rel, err := filepath.Rel(b.keyDir, p)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		panic("pyenv: " + p + " is not under " + b.keyDir)
	}
	return filepath.Join(SandboxRoot, b.key, rel)
}

// sandboxArgs is bubblewrap's command line, up to and including "--", for
// a command that sees the host's root read-only, work bound at /work, the
// writable binds rw (host path → path inside), no network, and chdir as
// its working directory. The root is bubblewrap's own, holding binds of the
// host's top-level entries, so that /work is a mount point whether or not
// the host has one.
func sandboxArgs(work, chdir string, rw [][2]string) ([]string, error) {
	// SandboxRoot: a host's own is never the cache.
	root, err := bwrap.HostRoot("/work", SandboxRoot)
	if err != nil {
		return nil, err
	}
	args := append([]string{"--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-net"}, root...)
	args = append(args, "--proc", "/proc", "--dev-bind", "/dev", "/dev")
	for _, d := range rw {
		args = append(args, "--bind", d[0], d[1])
	}
	args = append(args, "--bind", work, "/work", "--chdir", chdir, "--")
	return args, nil
}

// tailBuffer keeps the last 64 KiB written to it.
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	const max = 64 << 10
	t.b = append(t.b, p...)
	if len(t.b) > max {
		t.b = append([]byte{}, t.b[len(t.b)-max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) Bytes() []byte { return t.b }

// tail returns the last n non-empty lines of b.
func tail(b []byte, n int) string {
	var lines []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(l) != "" {
			lines = append(lines, strings.TrimRight(l, "\r"))
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func lastLine(b []byte) []byte {
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	return lines[len(lines)-1]
}

func short(commit string) string {
	if len(commit) > 12 {
		return commit[:12]
	}
	return commit
}

func majorMinor(v string) string {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return ""
	}
	return parts[0] + "." + parts[1]
}

func under(p, dir string) bool {
	p = filepath.Clean(p)
	return p == dir || strings.HasPrefix(p, dir+"/")
}

func mustAbs(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		if r, err := filepath.EvalSymlinks(a); err == nil {
			return r
		}
		return a
	}
	return p
}

func isDir(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

func round(s float64) float64 { return float64(int64(s*10+0.5)) / 10 }
