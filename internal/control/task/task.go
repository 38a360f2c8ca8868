// Package task owns repository tasks: what an episode works on (a work tree
// with a bug, a problem statement, a test command and SWE-bench's
// FAIL_TO_PASS and PASS_TO_PASS lists), where tasks come from (the built-in
// set embedded in stasis, task directories on disk, SWE-bench JSONL over
// local clones), how a test run's output becomes per-test results and a
// reward, and capture-once verify: an episode's result is recorded once and
// every later verify returns the record.
package task

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"
)

// WorkDir is where a task's work tree lives inside a sandbox.
const WorkDir = "/work"

// DefaultBudget is a task's time budget when its definition gives none.
const DefaultBudget = 10 * time.Minute

// Task is one repository task.
type Task struct {
	ID       string `json:"id"`
	Language string `json:"language,omitempty"`
	Title    string `json:"title,omitempty"`
	// Statement is the problem statement the harness is given.
	Statement string `json:"statement"`
	// TestCmd runs the tests: a shell command run with /bin/sh -c in the
	// work tree.
	TestCmd string `json:"test_cmd"`
	// Parser names how TestCmd's output gives per-test results (Parsers).
	Parser     string   `json:"parser"`
	FailToPass []string `json:"fail_to_pass"`
	PassToPass []string `json:"pass_to_pass"`
	// BudgetS is the time budget in seconds for the harness (and, again,
	// for the tests).
	BudgetS float64 `json:"budget_s,omitempty"`
	// Env is added to the environment of the harness and the tests.
	Env map[string]string `json:"env,omitempty"`
	// Image is the image the task's sandboxes run on: an image reference
	// (oci:PATH[:TAG], docker-archive:PATH, docker://HOST/REPO:TAG,
	// sha256:HEX) on the local and microvm providers, the service's
	// template or image name on a hosted one. Empty: the run's default
	// (--image), else the provider's own root.
	Image string `json:"image,omitempty"`
	// TestFiles are the files and directories of the work tree (relative,
	// slash-separated) that hold the tests. Verify restores them from the
	// task before it runs the tests: the agent may read them, but its
	// edits to them do not count.
	TestFiles []string `json:"test_files"`

	// Source is the work tree; Solution the reference fix (for the
	// scripted model only). Neither is part of the JSON definition.
	Source   Source    `json:"-"`
	Solution *Solution `json:"-"`
	// Tests gives the content verify restores (TestTree); nil: the
	// TestFiles as the Source holds them.
	Tests func() (TestTree, error) `json:"-"`
	// Environ resolves the environment the harness and the tests run in;
	// nil: the sandbox as the provider makes it (the host's userland, for
	// a local sandbox).
	Environ EnvResolver `json:"-"`
	// SWEBench is the instance a SWE-bench task was made from; nil for
	// other tasks.
	SWEBench *Instance `json:"-"`

	env *envMemo
}

// EnvResolver finds, or builds once, the environment a task runs in.
type EnvResolver interface {
	Resolve(ctx context.Context) (Environment, error)
}

// Environment is what a task's harness and tests run in, as recorded in
// the episode and its verdict.
type Environment struct {
	// Kind is "venv" (a Python environment stasis built and cached),
	// "image" or "host" (the sandbox's own userland).
	Kind string `json:"kind"`
	// Name identifies it: the venv's cache key, an image digest.
	Name string `json:"name,omitempty"`
	// Path is where it is on the host, when it is there.
	Path string `json:"path,omitempty"`
	// Warning says what to beware of (the host's userland is not the
	// instance's environment, say).
	Warning string `json:"warning,omitempty"`
	// Vars are added to the environment of the harness and the tests.
	Vars map[string]string `json:"-"`
	// Overlay, when set, lays what the environment's build made in its
	// own checkout (version files, compiled extensions) into a fresh work
	// tree, where the tree lacks them.
	Overlay func(tree string) error `json:"-"`
}

// String is how a verdict or a report names the environment.
func (e Environment) String() string {
	if e.Name == "" {
		return e.Kind
	}
	return e.Kind + ":" + e.Name
}

type envMemo struct {
	mu   sync.Mutex
	done bool
	env  Environment
}

// Environment resolves the task's environment once (later calls return
// the first success; a failure is tried again next time).
func (t *Task) Environment(ctx context.Context) (Environment, error) {
	if t.Environ == nil {
		return Environment{Kind: "host"}, nil
	}
	m := t.memo()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.done {
		return m.env, nil
	}
	e, err := t.Environ.Resolve(ctx)
	if err != nil {
		return Environment{}, fmt.Errorf("task %s: environment: %w", t.ID, err)
	}
	m.env, m.done = e, true
	return e, nil
}

var memoMu sync.Mutex

func (t *Task) memo() *envMemo {
	memoMu.Lock()
	defer memoMu.Unlock()
	if t.env == nil {
		t.env = &envMemo{}
	}
	return t.env
}

// resolved is the environment when it has been resolved.
func (t *Task) resolved() (Environment, bool) {
	if t.Environ == nil {
		return Environment{Kind: "host"}, true
	}
	m := t.memo()
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.env, m.done
}

// Budget is the task's time budget.
func (t *Task) Budget() time.Duration {
	if t.BudgetS <= 0 {
		return DefaultBudget
	}
	return time.Duration(t.BudgetS * float64(time.Second))
}

// Solution is a reference fix: whole files (path relative to the work tree
// → content), or a unified diff that `git apply` takes.
type Solution struct {
	Files map[string][]byte
	Patch string
}

// Paths are the files the solution writes, sorted.
func (s *Solution) Paths() []string {
	ps := make([]string, 0, len(s.Files))
	for p := range s.Files {
		ps = append(ps, p)
	}
	sort.Strings(ps)
	return ps
}

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// Validate checks a task's definition and says what is wrong with it.
func (t *Task) Validate() error {
	var errs []string
	if !idRE.MatchString(t.ID) || strings.Contains(t.ID, "..") {
		errs = append(errs, fmt.Sprintf("id %q: use 1-128 letters, digits, '.', '_' or '-'", t.ID))
	}
	if strings.TrimSpace(t.Statement) == "" {
		errs = append(errs, "statement is empty")
	}
	if strings.TrimSpace(t.TestCmd) == "" {
		errs = append(errs, "test_cmd is empty")
	}
	if t.Image != strings.TrimSpace(t.Image) || len(t.Image) > 4096 || strings.ContainsAny(t.Image, "\x00\n") {
		errs = append(errs, fmt.Sprintf("image %.60q: give one reference, with no spaces around it", t.Image))
	}
	if _, ok := Parsers[t.Parser]; !ok {
		errs = append(errs, fmt.Sprintf("parser %q: want one of %s", t.Parser, strings.Join(ParserNames(), ", ")))
	}
	if len(t.FailToPass) == 0 {
		errs = append(errs, "fail_to_pass is empty: a task needs at least one test the fix makes pass")
	}
	seen := map[string]bool{}
	for _, n := range append(append([]string{}, t.FailToPass...), t.PassToPass...) {
		if n == "" {
			errs = append(errs, "a test name is empty")
		} else if seen[n] {
			errs = append(errs, fmt.Sprintf("test %q is listed twice", n))
		}
		seen[n] = true
	}
	if t.BudgetS < 0 {
		errs = append(errs, "budget_s is negative")
	}
	for _, f := range t.TestFiles {
		if err := checkRelPath(f); err != nil {
			errs = append(errs, fmt.Sprintf("test_files: %v", err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("task %s: %s", t.ID, strings.Join(errs, "; "))
	}
	return nil
}

// Source is where a task's work tree comes from: a directory (on disk or in
// an fs.FS), a tarball, a git bundle, or a function that makes it.
type Source struct {
	// Kind is "dir", "tar", "bundle" or "func".
	Kind string
	// Path is the directory, tarball or bundle on the host (dir, tar,
	// bundle); for a dir, FS may hold it instead (Path is then the root
	// within FS).
	Path string
	FS   fs.FS
	// Ref is the commit or branch to check out of a bundle (default HEAD).
	Ref string
	// Make writes the work tree into an empty directory (func).
	Make func(dst string) error
}

// Materialize writes the task's work tree into dst, a directory that is
// empty or does not exist.
func (t *Task) Materialize(dst string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("task %s: %w", t.ID, err)
	}
	if ents, err := os.ReadDir(dst); err != nil {
		return fmt.Errorf("task %s: %w", t.ID, err)
	} else if len(ents) > 0 {
		return fmt.Errorf("task %s: materialize into %s: the directory is not empty", t.ID, dst)
	}
	var err error
	switch s := t.Source; s.Kind {
	case "dir":
		if s.FS != nil {
			err = copyFS(s.FS, s.Path, dst)
		} else {
			err = copyFS(os.DirFS(s.Path), ".", dst)
		}
	case "tar":
		err = extractTar(s.Path, dst)
	case "bundle":
		err = cloneBundle(s.Path, s.Ref, dst)
	case "func":
		err = s.Make(dst)
	default:
		err = fmt.Errorf("no work tree source (kind %q)", s.Kind)
	}
	if err != nil {
		return fmt.Errorf("task %s: materialize the work tree: %w", t.ID, err)
	}
	if e, ok := t.resolved(); ok && e.Overlay != nil {
		if err := e.Overlay(dst); err != nil {
			return fmt.Errorf("task %s: lay the environment's generated files into the work tree: %w", t.ID, err)
		}
	}
	return nil
}

// embedSuffix marks a file stored under another name in an embedded tree
// (go.mod.embed is go.mod: Go refuses to embed a directory holding a
// go.mod).
const embedSuffix = ".embed"

// copyFS copies the tree at root in fsys into dst, dropping embedSuffix
// from file names; symlinks and special files are refused.
func copyFS(fsys fs.FS, root, dst string) error {
	return fs.WalkDir(fsys, root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(p, root), "/")
		if root == "." {
			rel = p
		}
		if rel == "." || rel == "" {
			return nil
		}
		target := filepath.Join(dst, filepath.FromSlash(strings.TrimSuffix(rel, embedSuffix)))
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case d.Type().IsRegular():
			b, err := fs.ReadFile(fsys, p)
			if err != nil {
				return err
			}
			mode := fs.FileMode(0o644)
			if info, err := d.Info(); err == nil && info.Mode().Perm()&0o111 != 0 {
				mode = 0o755
			}
			if strings.HasSuffix(rel, ".sh") {
				mode = 0o755
			}
			return os.WriteFile(target, b, mode)
		default:
			return fmt.Errorf("%s: not a regular file or directory", p)
		}
	})
}

// readSolution reads whole-file solutions from dir in fsys.
func readSolution(fsys fs.FS, dir string) (*Solution, error) {
	sol := &Solution{Files: map[string][]byte{}}
	err := fs.WalkDir(fsys, dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s: not a regular file", p)
		}
		b, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		rel := strings.TrimSuffix(strings.TrimPrefix(p, dir+"/"), embedSuffix)
		sol.Files[rel] = b
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(sol.Files) == 0 {
		return nil, errors.New("the solution directory is empty")
	}
	return sol, nil
}

// LoadFS reads the task in directory dir of fsys: dir/task.json, the work
// tree dir/repo, and the reference solution dir/solution (whole files) or
// dir/solution.patch (a diff), both optional.
func LoadFS(fsys fs.FS, dir string) (*Task, error) {
	b, err := fs.ReadFile(fsys, path.Join(dir, "task.json"))
	if err != nil {
		return nil, fmt.Errorf("task %s: %w", dir, err)
	}
	t, err := ParseDefinition(b)
	if err != nil {
		return nil, fmt.Errorf("task %s: %w", dir, err)
	}
	repo := path.Join(dir, "repo")
	if st, err := fs.Stat(fsys, repo); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("task %s: no work tree: want a directory %s", t.ID, repo)
	}
	t.Source = Source{Kind: "dir", FS: fsys, Path: repo}
	if len(t.TestFiles) == 0 {
		return nil, fmt.Errorf("task %s: test_files is empty: name the files (or directories) of repo/ that hold the tests, so that verify restores them and an agent's edits to them do not count", t.ID)
	}
	for _, f := range t.TestFiles {
		if _, err := fs.Stat(fsys, path.Join(repo, f)); err != nil {
			if _, err2 := fs.Stat(fsys, path.Join(repo, f+embedSuffix)); err2 != nil {
				return nil, fmt.Errorf("task %s: test_files: %s is not in the work tree", t.ID, f)
			}
		}
	}
	if st, err := fs.Stat(fsys, path.Join(dir, "solution")); err == nil && st.IsDir() {
		if t.Solution, err = readSolution(fsys, path.Join(dir, "solution")); err != nil {
			return nil, fmt.Errorf("task %s: solution: %w", t.ID, err)
		}
	} else if p, err := fs.ReadFile(fsys, path.Join(dir, "solution.patch")); err == nil {
		t.Solution = &Solution{Patch: string(p)}
	}
	return t, nil
}

// LoadDir reads a task directory on disk (the layout LoadFS reads).
func LoadDir(dir string) (*Task, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	return LoadFS(os.DirFS(abs), ".")
}

// ParseDefinition decodes and validates a task.json document; unknown
// fields are refused, so that a misspelt field is not silently ignored.
func ParseDefinition(b []byte) (*Task, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	var t Task
	if err := d.Decode(&t); err != nil {
		return nil, fmt.Errorf("task.json: %w", err)
	}
	if d.More() {
		return nil, errors.New("task.json: trailing data after the task")
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	return &t, nil
}

// checkRelPath refuses a path that is not a clean relative path inside the
// work tree.
func checkRelPath(p string) error {
	switch {
	case p == "" || p == ".":
		return errors.New("an empty path")
	case strings.HasPrefix(p, "/"):
		return fmt.Errorf("%q is absolute: give it relative to the work tree", p)
	case path.Clean(p) != p || p == ".." || strings.HasPrefix(p, "../") || strings.Contains(p, "\x00"):
		return fmt.Errorf("%q: give a clean path inside the work tree (no '..', no './', no trailing '/')", p)
	case p == ".git" || strings.HasPrefix(p, ".git/"):
		return fmt.Errorf("%q is inside .git", p)
	}
	return nil
}

// EnvMap is the environment a task's harness and tests run with inside a
// sandbox: the task's own, its resolved environment's (call Environment
// first), and a PATH that also reaches the host's Go toolchain (local
// sandboxes see the host's root read-only).
func (t *Task) EnvMap() map[string]string {
	// No stale bytecode: a fix of the same size written within the same
	// second as the original would otherwise run the old code.
	env := map[string]string{"PATH": SandboxPath(), "PYTHONDONTWRITEBYTECODE": "1"}
	if e, ok := t.resolved(); ok {
		for k, v := range e.Vars {
			env[k] = v
		}
	}
	for k, v := range t.Env {
		env[k] = v
	}
	return env
}

// SandboxPath is PATH for commands in a sandbox: the usual system
// directories, after the directory of the host's go, when it has one. It is
// worked out once per process (every episode start and test run asks).
func SandboxPath() string { return sandboxPath() }

var sandboxPath = sync.OnceValue(func() string {
	p := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if g, err := exec.LookPath("go"); err == nil {
		if abs, err := filepath.EvalSymlinks(g); err == nil {
			g = abs
		}
		if d := filepath.Dir(g); !strings.Contains(":"+p+":", ":"+d+":") {
			p = d + ":" + p
		}
	}
	return p
})
