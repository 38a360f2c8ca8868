package task

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"

	"stasis/internal/control/task/pyenv"
)

// Instance is one line of a SWE-bench JSONL file (the published datasets'
// fields; others are ignored). FAIL_TO_PASS and PASS_TO_PASS may be JSON
// lists or, as in the published dataset, strings holding JSON lists.
// test_cmd, parser and budget_s are stasis's additions: without test_cmd
// the command is the one SWE-bench's harness runs for the repository
// (HarnessTest); without parser, the one its command implies.
type Instance struct {
	InstanceID             string          `json:"instance_id"`
	Repo                   string          `json:"repo"`
	BaseCommit             string          `json:"base_commit"`
	ProblemStatement       string          `json:"problem_statement"`
	Patch                  string          `json:"patch"`
	TestPatch              string          `json:"test_patch"`
	FailToPass             json.RawMessage `json:"FAIL_TO_PASS"`
	PassToPass             json.RawMessage `json:"PASS_TO_PASS"`
	Version                json.RawMessage `json:"version,omitempty"`
	EnvironmentSetupCommit string          `json:"environment_setup_commit,omitempty"`
	// LogParser names the harness's log parser (SWE-bench 5's rows carry
	// it: parse_log_pytest, ...).
	LogParser string  `json:"log_parser,omitempty"`
	TestCmd   string  `json:"test_cmd,omitempty"`
	Parser    string  `json:"parser,omitempty"`
	BudgetS   float64 `json:"budget_s,omitempty"`
	// Image is the image the instance's sandboxes run on (its environment
	// image, as a reference; see Task.Image), when the row names one.
	Image string `json:"image,omitempty"`
}

// VersionString is the instance's version: the datasets hold it as a
// string ("2.3"), some copies as a number.
func (in *Instance) VersionString() string {
	v := bytes.TrimSpace(in.Version)
	var s string
	if json.Unmarshal(v, &s) == nil {
		return s
	}
	return string(v)
}

// SWEBenchOptions say where SWE-bench instances find their repositories
// and environments.
type SWEBenchOptions struct {
	// Repos holds the git clones (or bundles; see findClone).
	Repos string
	// Envs is the directory where Python environments are built and
	// cached, one per repository and environment_setup_commit (see
	// internal/control/task/pyenv); empty: the tests run in the sandbox's own userland
	// (the host's, for a local sandbox), with a warning.
	Envs string
	// Log gets the environment builds' progress; nil: slog.Default().
	Log *slog.Logger
}

// MaxInstanceLine bounds one JSONL line (SWE-bench statements and patches
// can be long, but not this long).
const MaxInstanceLine = 64 << 20

// LoadSWEBench reads a SWE-bench JSONL file and makes a task of each
// instance whose repository is under o.Repos: a clone or a git bundle
// named as SWE-bench names repositories, OWNER__NAME (also OWNER/NAME or
// NAME; a bundle with .bundle added). Each task's work tree is the
// repository at base_commit, without test_patch and without the history
// after it; verify restores every file test_patch touches to base_commit
// with test_patch applied, then runs the tests. Its reference solution is
// the instance's patch. An instance that cannot be loaded (no clone, a
// commit the clone lacks, a test patch that does not apply, a malformed
// line) is returned in problems, naming the instance and the reason; err
// is for the file itself.
func LoadSWEBench(file string, o SWEBenchOptions) (ts []*Task, problems []error, err error) {
	repos := o.Repos
	f, err := os.Open(file)
	if err != nil {
		return nil, nil, fmt.Errorf("swe-bench: %w", err)
	}
	defer f.Close()
	if repos == "" {
		return nil, nil, fmt.Errorf("swe-bench %s: no repository directory: give the directory that holds the git clones (--repos DIR)", file)
	}
	// Absolute: a work tree is made by git commands run elsewhere.
	if o.Repos, err = filepath.Abs(repos); err != nil {
		return nil, nil, err
	}
	if _, err := exec.LookPath("git"); err != nil {
		return nil, nil, errors.New("swe-bench: git is not installed (apt-get install git)")
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 1<<20), MaxInstanceLine)
	seen := map[string]int{}
	n := 0
	for sc.Scan() {
		n++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		t, err := instanceTask(line, o)
		if err != nil {
			problems = append(problems, fmt.Errorf("%s:%d: %w", file, n, err))
			continue
		}
		if first, dup := seen[t.ID]; dup {
			problems = append(problems, fmt.Errorf("%s:%d: instance %s: already loaded from line %d", file, n, t.ID, first))
			continue
		}
		seen[t.ID] = n
		ts = append(ts, t)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("swe-bench %s: line %d: %w", file, n+1, err)
	}
	return ts, problems, nil
}

// testList decodes a FAIL_TO_PASS or PASS_TO_PASS value.
func testList(raw json.RawMessage) ([]string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, err
		}
		raw = []byte(s)
	}
	var l []string
	if err := json.Unmarshal(raw, &l); err != nil {
		return nil, fmt.Errorf("want a JSON list of test names: %w", err)
	}
	return l, nil
}

var commitRE = regexp.MustCompile(`^[0-9a-f]{7,64}$`)

func instanceTask(line []byte, o SWEBenchOptions) (*Task, error) {
	var in Instance
	if err := json.Unmarshal(line, &in); err != nil {
		return nil, fmt.Errorf("not a SWE-bench instance: %w", err)
	}
	if in.InstanceID == "" {
		return nil, errors.New("instance_id is missing")
	}
	f2p, p2p, clone, err := in.check(o)
	if err != nil {
		return nil, err
	}
	// The test patch applied to base in a throwaway index: what verify
	// restores, and the files of the task's own tree.
	tests, err := testPatchTree(clone, in.BaseCommit, in.TestPatch)
	if err != nil {
		return nil, in.errorf("test_patch does not apply at %s: %v", in.BaseCommit, err)
	}
	t := &Task{
		ID: in.InstanceID, Language: "python", Title: in.Repo + " " + in.InstanceID,
		Statement: in.ProblemStatement, TestCmd: in.TestCmd, Parser: in.Parser,
		FailToPass: f2p, PassToPass: p2p, BudgetS: in.BudgetS, TestFiles: tests.Paths, Image: in.Image,
	}
	if err := in.testCommand(t); err != nil {
		return nil, err
	}
	if err := t.Validate(); err != nil {
		return nil, in.errorf("%v", err)
	}
	if strings.TrimSpace(in.Patch) != "" {
		t.Solution = &Solution{Patch: in.Patch}
	}
	inst := in
	t.SWEBench = &inst
	t.Tests = func() (TestTree, error) { return tests, nil }
	base := in.BaseCommit
	t.Source = Source{Kind: "func", Path: clone, Make: func(dst string) error {
		// Only base_commit: the history after it holds the fix.
		if err := git("", "init", "--quiet", dst); err != nil {
			return err
		}
		if err := git(dst, "fetch", "--quiet", "--no-tags", "--depth", "1", clone, base); err != nil {
			return err
		}
		return git(dst, "checkout", "--quiet", "--detach", base)
	}}
	envCommit := in.EnvironmentSetupCommit
	if envCommit == "" {
		envCommit = base
	}
	t.Environ = &pyEnv{dir: o.Envs, log: o.Log, req: pyenv.Request{Repo: in.Repo, Clone: clone, Commit: envCommit}}
	return t, nil
}

// errorf is an error about the instance.
func (in *Instance) errorf(format string, a ...any) error {
	return fmt.Errorf("instance %s: %s", in.InstanceID, fmt.Sprintf(format, a...))
}

// check checks the instance's fields, and finds its repository's clone
// under o.Repos with the base commit in it: the test lists, and the
// clone.
func (in *Instance) check(o SWEBenchOptions) (f2p, p2p []string, clone string, err error) {
	if f2p, err = testList(in.FailToPass); err != nil {
		return nil, nil, "", in.errorf("FAIL_TO_PASS: %v", err)
	}
	if p2p, err = testList(in.PassToPass); err != nil {
		return nil, nil, "", in.errorf("PASS_TO_PASS: %v", err)
	}
	if !commitRE.MatchString(in.BaseCommit) {
		return nil, nil, "", in.errorf("base_commit %q is not a commit hash", in.BaseCommit)
	}
	if in.EnvironmentSetupCommit != "" && !commitRE.MatchString(in.EnvironmentSetupCommit) {
		return nil, nil, "", in.errorf("environment_setup_commit %q is not a commit hash", in.EnvironmentSetupCommit)
	}
	if in.Repo == "" || strings.Contains(in.Repo, "..") || strings.Count(in.Repo, "/") != 1 {
		return nil, nil, "", in.errorf("repo %q: want OWNER/NAME", in.Repo)
	}
	clone, looked, err := findClone(o.Repos, in.Repo)
	if err != nil {
		return nil, nil, "", in.errorf("%v", err)
	}
	if clone == "" {
		return nil, nil, "", in.errorf("repository %s is not here (looked for %s)", in.Repo, strings.Join(looked, ", "))
	}
	if err := git(clone, "cat-file", "-e", in.BaseCommit+"^{commit}"); err != nil {
		return nil, nil, "", in.errorf("the clone %s has no commit %s (fetch it, or use a fuller clone)", clone, in.BaseCommit)
	}
	if strings.TrimSpace(in.TestPatch) == "" {
		return nil, nil, "", in.errorf("test_patch is empty: SWE-bench's tests come with it")
	}
	return f2p, p2p, clone, nil
}

// testCommand completes t's test command and parser: the log parser the
// instance names, else SWE-bench's harness's command for the repository,
// else the parser the command implies.
func (in *Instance) testCommand(t *Task) error {
	if t.Parser == "" && in.LogParser != "" {
		p, ok := HarnessParser(in.LogParser)
		if !ok {
			return in.errorf("log_parser %q: stasis has no such parser (%s)", in.LogParser, strings.Join(ParserNames(), ", "))
		}
		t.Parser = p
	}
	if t.TestCmd == "" {
		h, err := HarnessTest(in.Repo, in.VersionString(), in.TestPatch)
		if err != nil {
			return in.errorf("%v", err)
		}
		t.TestCmd = h.TestCmd
		if t.Parser == "" {
			t.Parser = h.Parser
		}
	}
	if t.Parser == "" {
		p, ok := DefaultParser(t.TestCmd)
		if !ok {
			return in.errorf("parser: test_cmd %q implies no parser; name one (%s)", t.TestCmd, strings.Join(ParserNames(), ", "))
		}
		t.Parser = p
	}
	return nil
}

// EnvsOption reads an --envs flag: "" is the user's cache directory
// (~/.cache/stasis/envs, or $XDG_CACHE_HOME/stasis/envs), "host" is no
// environment (the sandbox's own userland), anything else a directory.
func EnvsOption(flag string) (SWEBenchOptions, error) {
	switch flag {
	case "host":
		return SWEBenchOptions{}, nil
	case "":
		d, err := os.UserCacheDir()
		if err != nil {
			return SWEBenchOptions{}, fmt.Errorf("--envs: no cache directory (set HOME or XDG_CACHE_HOME, or give --envs DIR): %w", err)
		}
		return SWEBenchOptions{Envs: filepath.Join(d, "stasis", "envs")}, nil
	}
	abs, err := filepath.Abs(flag)
	if err != nil {
		return SWEBenchOptions{}, err
	}
	return SWEBenchOptions{Envs: abs}, nil
}

// pyEnv resolves a SWE-bench task's environment: a Python environment
// built once per repository and environment_setup_commit when a cache
// directory is given, else the host's, with a warning.
type pyEnv struct {
	dir string
	log *slog.Logger
	req pyenv.Request
}

func (p *pyEnv) Resolve(ctx context.Context) (Environment, error) {
	log := p.log
	if log == nil {
		log = slog.Default()
	}
	if p.dir == "" {
		w := fmt.Sprintf("no environment for %s: the tests run with the sandbox's own Python and packages, not the instance's", p.req.Repo)
		log.Warn(w)
		return Environment{Kind: "host", Warning: w}, nil
	}
	e, err := pyenv.Ensure(ctx, p.dir, p.req, log)
	if err != nil {
		return Environment{}, err
	}
	return Environment{Kind: "venv", Name: e.Key, Path: e.Dir, Vars: e.Vars(SandboxPath()), Overlay: func(tree string) error {
		_, err := e.Overlay(tree)
		return err
	}}, nil
}

// testPatchTree applies a test patch to commit in a throwaway index and
// reads what verify restores: every file the patch touches, with its
// content after the patch (a file it deletes is only removed), and the
// list of all files then.
func testPatchTree(clone, commit, patch string) (TestTree, error) {
	dir, err := os.MkdirTemp("", "stasis-swebench-")
	if err != nil {
		return TestTree{}, err
	}
	defer os.RemoveAll(dir)
	env := []string{"GIT_INDEX_FILE=" + filepath.Join(dir, "index")}
	paths, err := applyTestPatch(clone, env, dir, commit, patch)
	if err != nil {
		return TestTree{}, err
	}
	tt, named, err := stagedTests(clone, env, paths)
	if err != nil {
		return TestTree{}, err
	}
	for f := range paths {
		tt.Paths = append(tt.Paths, f)
	}
	sort.Strings(tt.Paths)
	// The sums of the other test-named files, read in one pass; their
	// content is read again only for one the agent changed.
	if err := blobSums(clone, named, tt.Sums); err != nil {
		return TestTree{}, err
	}
	tt.Read = func(p string) (TestFile, error) {
		blob, ok := named[p]
		if !ok {
			return TestFile{}, fmt.Errorf("%s is not a test file of the task", p)
		}
		b, err := gitRaw(clone, nil, "cat-file", "blob", blob)
		if err != nil {
			return TestFile{}, err
		}
		return TestFile{Path: p, Data: []byte(b), Mode: 0o644}, nil
	}
	return tt, nil
}

// applyTestPatch applies the patch to commit in the index env names (a
// file in dir): the paths it touches.
func applyTestPatch(clone string, env []string, dir, commit, patch string) (map[string]bool, error) {
	p := filepath.Join(dir, "test.patch")
	if err := os.WriteFile(p, []byte(patch), 0o644); err != nil {
		return nil, err
	}
	for _, args := range [][]string{{"read-tree", commit}, {"apply", "--cached", p}} {
		if _, err := runGit(clone, env, args...); err != nil {
			return nil, err
		}
	}
	touched, err := gitRaw(clone, env, "apply", "--numstat", "-z", p)
	if err != nil {
		return nil, err
	}
	paths := map[string]bool{}
	for _, f := range numstatPaths(touched) {
		if err := checkRelPath(f); err != nil {
			return nil, fmt.Errorf("the patch touches %v", err)
		}
		paths[f] = true
	}
	if len(paths) == 0 {
		return nil, errors.New("it touches no file")
	}
	return paths, nil
}

// stagedTests reads the index env names: every file in it (Known), the
// content of the files paths names (Files), and the blobs of the other
// test-named files (named).
func stagedTests(clone string, env []string, paths map[string]bool) (tt TestTree, named map[string]string, err error) {
	staged, err := gitRaw(clone, env, "ls-files", "--stage", "-z")
	if err != nil {
		return TestTree{}, nil, err
	}
	tt = TestTree{Known: map[string]bool{}, Sums: map[string]string{}}
	named = map[string]string{} // test-named files (TestPatterns) → blob
	for _, ent := range strings.Split(staged, "\x00") {
		// MODE SHA STAGE\tPATH
		meta, name, ok := strings.Cut(ent, "\t")
		if !ok {
			continue
		}
		tt.Known[name] = true
		f := strings.Fields(meta)
		if len(f) != 3 {
			return TestTree{}, nil, fmt.Errorf("git ls-files: %q", ent)
		}
		if !paths[name] {
			if (f[0] == "100644" || f[0] == "100755") && isTestName(name) {
				named[name] = f[1]
			}
			continue
		}
		mode := fs.FileMode(0o644)
		switch f[0] {
		case "100755":
			mode = 0o755
		case "100644":
		default:
			return TestTree{}, nil, fmt.Errorf("the patch leaves %s as a link or submodule (mode %s): only regular files are restored", name, f[0])
		}
		b, err := gitRaw(clone, nil, "cat-file", "blob", f[1])
		if err != nil {
			return TestTree{}, nil, err
		}
		tt.Files = append(tt.Files, TestFile{Path: name, Data: []byte(b), Mode: mode})
	}
	return tt, named, nil
}

// blobSums reads the blobs (path → blob id) with one git cat-file --batch
// and puts each one's SHA-256 sum in sums.
func blobSums(clone string, blobs map[string]string, sums map[string]string) error {
	if len(blobs) == 0 {
		return nil
	}
	paths := make([]string, 0, len(blobs))
	var in strings.Builder
	for p := range blobs {
		paths = append(paths, p)
	}
	for _, p := range paths { // one line per path, in this order
		in.WriteString(blobs[p] + "\n")
	}
	cmd := exec.Command("git", "cat-file", "--batch")
	cmd.Dir = clone
	cmd.Env = append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null")
	cmd.Stdin = strings.NewReader(in.String())
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("git cat-file --batch: %w", err)
	}
	for _, p := range paths {
		// "<sha> blob <size>\n<content>\n"
		head, rest, ok := bytes.Cut(out, []byte("\n"))
		if !ok {
			return errors.New("git cat-file --batch: cut short")
		}
		f := strings.Fields(string(head))
		if len(f) != 3 || f[1] != "blob" {
			return fmt.Errorf("git cat-file --batch: %q", head)
		}
		n, err := strconv.Atoi(f[2])
		if err != nil || n < 0 || n+1 > len(rest) {
			return fmt.Errorf("git cat-file --batch: %q", head)
		}
		sums[p] = sha256Hex(rest[:n])
		out = rest[n+1:]
	}
	return nil
}

// numstatPaths reads the paths of `git apply --numstat -z`: per file
// "ADDED\tDELETED\tPATH\0", or for a rename "ADDED\tDELETED\t\0OLD\0NEW\0".
func numstatPaths(out string) []string {
	var ps []string
	parts := strings.Split(out, "\x00")
	for i := 0; i < len(parts); i++ {
		fields := strings.SplitN(parts[i], "\t", 3)
		if len(fields) != 3 {
			continue
		}
		if fields[2] != "" {
			ps = append(ps, fields[2])
			continue
		}
		if i+2 < len(parts) {
			ps = append(ps, parts[i+1], parts[i+2])
			i += 2
		}
	}
	return ps
}

// DefaultParser is the parser a test command implies, when it implies
// one.
func DefaultParser(cmd string) (string, bool) {
	switch {
	case strings.Contains(cmd, "runtests.py"):
		return "django", true
	case strings.Contains(cmd, "bin/test"):
		return "sympy", true
	case strings.Contains(cmd, "pytest"):
		return "pytest", true
	case strings.Contains(cmd, "unittest"):
		return "unittest", true
	case strings.Contains(cmd, "go test"):
		return "gotest", true
	case strings.Contains(cmd, "--test-reporter=tap"):
		return "tap", true
	}
	return "", false
}

// findClone looks for a repository under repos: a clone, or a git bundle
// (OWNER__NAME.bundle, ...), which is cloned once beside it, into
// repos/.stasis-clones/OWNER__NAME-HASH (keyed by the bundle's content).
func findClone(repos, repo string) (string, []string, error) {
	owner, name, _ := strings.Cut(repo, "/")
	cands := []string{
		filepath.Join(repos, owner+"__"+name),
		filepath.Join(repos, owner, name),
		filepath.Join(repos, name),
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.IsDir() {
			if git(c, "rev-parse", "--git-dir") == nil {
				return c, cands, nil
			}
		}
	}
	var looked []string
	for _, c := range cands {
		looked = append(looked, c, c+".bundle")
		if st, err := os.Stat(c + ".bundle"); err == nil && st.Mode().IsRegular() {
			dir, err := cloneBundleOnce(c+".bundle", filepath.Join(repos, ".stasis-clones"), owner+"__"+name)
			return dir, looked, err
		}
	}
	return "", looked, nil
}

var bundleMu sync.Mutex

// fetchBundle makes a bare repository at dst holding every head of a
// bundle, whatever its refs are named (FETCH_HEAD included) and whether or
// not its history is whole: the heads of a shallow bundle (made from a
// clone of depth 1, say) are recorded as shallow, so that git does not
// look for their parents.
func fetchBundle(bundle, dst string) error {
	heads, err := runGit("", nil, "bundle", "list-heads", bundle)
	if err != nil {
		return err
	}
	if err := git("", "init", "--quiet", "--bare", dst); err != nil {
		return err
	}
	var shas, specs []string
	for i, l := range strings.Split(heads, "\n") {
		sha, ref, ok := strings.Cut(strings.TrimSpace(l), " ")
		if !ok || !commitRE.MatchString(sha) {
			continue
		}
		shas = append(shas, sha)
		specs = append(specs, fmt.Sprintf("%s:refs/stasis/bundle/%d", ref, i))
	}
	if len(specs) == 0 {
		return errors.New("it lists no heads")
	}
	whole := append([]string{"fetch", "--quiet", "--no-tags", bundle}, specs...)
	if err := git(dst, whole...); err == nil {
		return nil
	}
	// A shallow bundle: its heads' parents are not in it.
	if err := os.WriteFile(filepath.Join(dst, "shallow"), []byte(strings.Join(shas, "\n")+"\n"), 0o644); err != nil {
		return err
	}
	return git(dst, whole...)
}

// cloneBundleOnce clones a bundle into under/NAME-HASH unless it is there.
func cloneBundleOnce(bundle, under, name string) (string, error) {
	b, err := os.ReadFile(bundle)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	dir := filepath.Join(under, name+"-"+hex.EncodeToString(sum[:6]))
	bundleMu.Lock()
	defer bundleMu.Unlock()
	if git(dir, "rev-parse", "--git-dir") == nil {
		return dir, nil
	}
	if err := os.MkdirAll(under, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(under, ".tmp-"+name+"-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := fetchBundle(bundle, filepath.Join(tmp, "repo")); err != nil {
		return "", fmt.Errorf("bundle %s: %w", bundle, err)
	}
	if err := os.Rename(filepath.Join(tmp, "repo"), dir); err != nil && git(dir, "rev-parse", "--git-dir") != nil {
		return "", err
	}
	return dir, nil
}
