package task

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// Instance is one line of a SWE-bench JSONL file. FAIL_TO_PASS and
// PASS_TO_PASS may be JSON lists or, as in the published dataset, strings
// holding JSON lists. test_cmd and parser are stasis's additions: without
// them the tests the test patch touches run under pytest -rA.
type Instance struct {
	InstanceID       string          `json:"instance_id"`
	Repo             string          `json:"repo"`
	BaseCommit       string          `json:"base_commit"`
	ProblemStatement string          `json:"problem_statement"`
	Patch            string          `json:"patch"`
	TestPatch        string          `json:"test_patch"`
	FailToPass       json.RawMessage `json:"FAIL_TO_PASS"`
	PassToPass       json.RawMessage `json:"PASS_TO_PASS"`
	TestCmd          string          `json:"test_cmd,omitempty"`
	Parser           string          `json:"parser,omitempty"`
	BudgetS          float64         `json:"budget_s,omitempty"`
}

// MaxInstanceLine bounds one JSONL line (SWE-bench statements and patches
// can be long, but not this long).
const MaxInstanceLine = 64 << 20

// LoadSWEBench reads a SWE-bench JSONL file and makes a task of each
// instance whose repository is cloned under repos: as repos/OWNER__NAME
// (SWE-bench's naming), repos/OWNER/NAME or repos/NAME. Each task's work
// tree is a clone at base_commit with test_patch applied; its reference
// solution is the instance's patch. An instance that cannot be loaded (no
// clone, a commit the clone lacks, a test patch that does not apply, a
// malformed line) is returned in problems, naming the instance and the
// reason; err is for the file itself.
func LoadSWEBench(file, repos string) (ts []*Task, problems []error, err error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, nil, fmt.Errorf("swe-bench: %w", err)
	}
	defer f.Close()
	if repos == "" {
		return nil, nil, fmt.Errorf("swe-bench %s: no repository directory: give the directory that holds the git clones (--repos DIR)", file)
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
		t, err := instanceTask(line, repos)
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

func instanceTask(line []byte, repos string) (*Task, error) {
	var in Instance
	if err := json.Unmarshal(line, &in); err != nil {
		return nil, fmt.Errorf("not a SWE-bench instance: %w", err)
	}
	if in.InstanceID == "" {
		return nil, errors.New("instance_id is missing")
	}
	fail := func(format string, a ...any) error {
		return fmt.Errorf("instance %s: %s", in.InstanceID, fmt.Sprintf(format, a...))
	}
	f2p, err := testList(in.FailToPass)
	if err != nil {
		return nil, fail("FAIL_TO_PASS: %v", err)
	}
	p2p, err := testList(in.PassToPass)
	if err != nil {
		return nil, fail("PASS_TO_PASS: %v", err)
	}
	if !commitRE.MatchString(in.BaseCommit) {
		return nil, fail("base_commit %q is not a commit hash", in.BaseCommit)
	}
	if in.Repo == "" || strings.Contains(in.Repo, "..") {
		return nil, fail("repo %q: want OWNER/NAME", in.Repo)
	}
	clone, looked := findClone(repos, in.Repo)
	if clone == "" {
		return nil, fail("repository %s is not cloned here (looked for %s)", in.Repo, strings.Join(looked, ", "))
	}
	if err := git(clone, "cat-file", "-e", in.BaseCommit+"^{commit}"); err != nil {
		return nil, fail("the clone %s has no commit %s (fetch it, or use a fuller clone)", clone, in.BaseCommit)
	}
	if strings.TrimSpace(in.TestPatch) != "" {
		if err := checkPatch(clone, in.BaseCommit, in.TestPatch); err != nil {
			return nil, fail("test_patch does not apply at %s: %v", in.BaseCommit, err)
		}
	}
	t := &Task{
		ID: in.InstanceID, Language: "python", Title: in.Repo + " " + in.InstanceID,
		Statement: in.ProblemStatement, TestCmd: in.TestCmd, Parser: in.Parser,
		FailToPass: f2p, PassToPass: p2p, BudgetS: in.BudgetS,
	}
	if t.TestCmd == "" {
		files := patchFiles(in.TestPatch)
		if len(files) == 0 {
			return nil, fail("no test_cmd, and the test patch names no files to run")
		}
		t.TestCmd = "python3 -m pytest -rA " + strings.Join(quoteAll(files), " ")
		if t.Parser == "" {
			t.Parser = "pytest"
		}
	}
	if err := t.Validate(); err != nil {
		return nil, fail("%v", err)
	}
	if strings.TrimSpace(in.Patch) != "" {
		t.Solution = &Solution{Patch: in.Patch}
	}
	base, testPatch := in.BaseCommit, in.TestPatch
	t.Source = Source{Kind: "func", Path: clone, Make: func(dst string) error {
		if err := git("", "clone", "--quiet", "--no-checkout", "--no-hardlinks", clone, dst); err != nil {
			return err
		}
		if err := git(dst, "checkout", "--quiet", "--detach", base); err != nil {
			return err
		}
		if strings.TrimSpace(testPatch) == "" {
			return nil
		}
		p := filepath.Join(dst, ".git", "stasis-test.patch")
		if err := os.WriteFile(p, []byte(testPatch), 0o644); err != nil {
			return err
		}
		defer os.Remove(p)
		return git(dst, "apply", p)
	}}
	return t, nil
}

// findClone looks for a repository's clone under repos.
func findClone(repos, repo string) (string, []string) {
	owner, name, _ := strings.Cut(repo, "/")
	cands := []string{
		filepath.Join(repos, owner+"__"+name),
		filepath.Join(repos, owner, name),
		filepath.Join(repos, name),
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.IsDir() {
			if git(c, "rev-parse", "--git-dir") == nil {
				return c, cands
			}
		}
	}
	return "", cands
}

// checkPatch checks that a patch applies at commit without a work tree: in
// a throwaway index read from the commit.
func checkPatch(clone, commit, patch string) error {
	dir, err := os.MkdirTemp("", "stasis-swebench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	idx := filepath.Join(dir, "index")
	p := filepath.Join(dir, "test.patch")
	if err := os.WriteFile(p, []byte(patch), 0o644); err != nil {
		return err
	}
	for _, args := range [][]string{{"read-tree", commit}, {"apply", "--cached", "--check", p}} {
		if _, err := runGit(clone, []string{"GIT_INDEX_FILE=" + idx}, args...); err != nil {
			return err
		}
	}
	return nil
}

// patchFiles are the files a unified diff changes (its +++ b/ lines).
func patchFiles(patch string) []string {
	set := map[string]bool{}
	for _, l := range strings.Split(patch, "\n") {
		if rest, ok := strings.CutPrefix(l, "+++ b/"); ok {
			set[strings.TrimSpace(rest)] = true
		}
	}
	var fs []string
	for f := range set {
		fs = append(fs, f)
	}
	sort.Strings(fs)
	return fs
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	return out
}
