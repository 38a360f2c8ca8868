package task

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"stasis/sandbox"
)

// TestTree is what verify restores before it runs the tests: every path in
// Paths is removed from the work tree, then Files are written. A test path
// the task does not hold (one a test patch deletes) is only removed.
type TestTree struct {
	Paths []string
	Files []TestFile
	// Known lists every file of the task's own work tree (with the tests
	// in place); nil when unknown. A file the agent added that is named
	// as a test file (TestPatterns) and is not known is removed too: a new
	// test file or conftest.py could report tests as passed.
	Known map[string]bool
	// Sums are the SHA-256 sums (hex) of the known files named as test
	// files; one the agent changed is restored from Read.
	Sums map[string]string
	Read func(path string) (TestFile, error)
}

// isTestName says whether a file's base name matches TestPatterns.
func isTestName(p string) bool {
	base := path.Base(p)
	for _, pat := range TestPatterns {
		if ok, _ := path.Match(pat, base); ok {
			return true
		}
	}
	return false
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// TestPatterns name the files a test runner picks up by name (shell
// patterns, matched against the base name): Go's test files, pytest's and
// unittest's, pytest's conftest.py, and node's test files. Verify removes
// such files the agent added and restores those it changed.
var TestPatterns = []string{"*_test.go", "test_*.py", "*_test.py", "conftest.py", "*.test.js", "*.test.mjs", "*.test.cjs", "*.spec.js"}

// TestFile is one file of a TestTree.
type TestFile struct {
	Path string // relative to the work tree, slash-separated
	Data []byte
	Mode fs.FileMode // 0644 or 0755
}

// TestTree is the content of the task's tests: Tests when the task has
// it, else its TestFiles as its Source holds them.
func (t *Task) TestTree() (TestTree, error) {
	if t.Tests != nil {
		return t.Tests()
	}
	if len(t.TestFiles) == 0 {
		return TestTree{}, nil
	}
	dir, err := os.MkdirTemp("", "stasis-tests-")
	if err != nil {
		return TestTree{}, err
	}
	defer os.RemoveAll(dir)
	if err := t.Materialize(dir); err != nil {
		return TestTree{}, err
	}
	tt, err := readTestTree(dir, t.TestFiles)
	if err != nil {
		return TestTree{}, err
	}
	if tt.Known, err = listFiles(dir); err != nil {
		return TestTree{}, err
	}
	var named []string
	for f := range tt.Known {
		if isTestName(f) {
			named = append(named, f)
		}
	}
	sort.Strings(named)
	more, err := readTestTree(dir, named)
	if err != nil {
		return TestTree{}, err
	}
	files := map[string]TestFile{}
	tt.Sums = map[string]string{}
	for _, f := range more.Files {
		files[f.Path] = f
		tt.Sums[f.Path] = sha256Hex(f.Data)
	}
	tt.Read = func(p string) (TestFile, error) {
		f, ok := files[p]
		if !ok {
			return TestFile{}, fmt.Errorf("%s is not a test file of the task", p)
		}
		return f, nil
	}
	return tt, nil
}

// listFiles lists the files under root (relative, slash-separated),
// leaving out .git.
func listFiles(root string) (map[string]bool, error) {
	known := map[string]bool{}
	err := filepath.WalkDir(root, func(file string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		if !d.IsDir() {
			rel, err := filepath.Rel(root, file)
			if err != nil {
				return err
			}
			known[filepath.ToSlash(rel)] = true
		}
		return nil
	})
	return known, err
}

// readTestTree reads the test paths (files or directories) under root.
func readTestTree(root string, paths []string) (TestTree, error) {
	tt := TestTree{Paths: append([]string(nil), paths...)}
	for _, p := range paths {
		if err := checkRelPath(p); err != nil {
			return TestTree{}, err
		}
		err := filepath.WalkDir(filepath.Join(root, filepath.FromSlash(p)), func(file string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() {
				return nil
			}
			if !d.Type().IsRegular() {
				return fmt.Errorf("test file %s: not a regular file or directory", file)
			}
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			rel, err := filepath.Rel(root, file)
			if err != nil {
				return err
			}
			mode := fs.FileMode(0o644)
			if info.Mode().Perm()&0o111 != 0 {
				mode = 0o755
			}
			tt.Files = append(tt.Files, TestFile{Path: filepath.ToSlash(rel), Data: b, Mode: mode})
			return nil
		})
		if err != nil {
			return TestTree{}, fmt.Errorf("test file %s: %w", p, err)
		}
	}
	return tt, nil
}

// resetScript removes each test path given as an argument from the work
// tree, and first any symbolic link on the way to it, so that what is
// written next lands in the work tree itself.
const resetScript = `set -f
for p in "$@"; do
  d=
  IFS=/
  for c in $p; do
    d=${d:+$d/}$c
    if [ -L "$d" ]; then rm -f -- "$d"; fi
  done
  unset IFS
  rm -rf -- "$p"
done`

// findTestsScript prints, NUL-terminated, each file under the work tree
// (outside .git) whose name matches a pattern given as an argument, and
// its SHA-256 sum.
const findTestsScript = `set -f
expr=
for p in "$@"; do expr="${expr:+$expr -o }-name $p"; done
find . -path ./.git -prune -o -type f \( $expr \) -exec sh -c 'for f; do printf "%s\0" "$f"; s=$(sha256sum < "$f") || exit 1; printf "%s\0" "${s%% *}"; done' sum {} +`

// Reset is what ResetTests did.
type Reset struct {
	// Restored counts the test files written from the task.
	Restored int
	// Removed are test files the agent added, removed before the run;
	// Reverted those of the task it changed, restored.
	Removed, Reverted []string
}

// ResetTests restores the task's tests in a sandbox's work tree (see
// TestTree): whatever the agent did to them, or added beside them, does
// not count.
func ResetTests(ctx context.Context, p sandbox.Files, sandboxID string, t *Task) (Reset, error) {
	var r Reset
	tt, err := t.TestTree()
	if err != nil {
		return r, fmt.Errorf("task %s: read its tests: %w", t.ID, err)
	}
	// A task's Tests may hand every verify the same tree: what is added
	// below goes into a copy.
	tt.Files = append([]TestFile(nil), tt.Files...)
	if tt.Known != nil {
		if err := findChangedTests(ctx, p, sandboxID, t, &tt, &r); err != nil {
			return r, err
		}
	}
	paths := append(append(append([]string(nil), tt.Paths...), r.Removed...), r.Reverted...)
	if len(paths) == 0 {
		return r, nil
	}
	if err := runScript(ctx, p, sandboxID, t, "remove the tests", resetScript, "reset", paths, nil); err != nil {
		return r, err
	}
	if len(tt.Files) == 0 {
		return r, nil
	}
	buf, err := testsTar(t.ID, tt.Files)
	if err != nil {
		return r, err
	}
	if err := p.Upload(ctx, sandboxID, WorkDir, buf); err != nil {
		return r, fmt.Errorf("task %s: restore the tests in sandbox %s: %w", t.ID, sandboxID, err)
	}
	r.Restored = len(tt.Files)
	return r, nil
}

// findChangedTests looks in the sandbox's work tree for test files the
// agent added (r.Removed) and test files of the task it changed
// (r.Reverted, their content added to tt.Files).
func findChangedTests(ctx context.Context, p sandbox.Files, sandboxID string, t *Task, tt *TestTree, r *Reset) error {
	var out bytes.Buffer
	if err := runScript(ctx, p, sandboxID, t, "look for added test files", findTestsScript, "find-tests", TestPatterns, &out); err != nil {
		return err
	}
	listed := map[string]bool{}
	for _, p := range tt.Paths {
		listed[p] = true
	}
	fields := strings.Split(out.String(), "\x00")
	for i := 0; i+1 < len(fields); i += 2 {
		f, sum := strings.TrimPrefix(fields[i], "./"), fields[i+1]
		switch {
		case f == "" || checkRelPath(f) != nil || listed[f]:
		case !tt.Known[f]:
			r.Removed = append(r.Removed, f)
		case tt.Sums != nil && tt.Read != nil && tt.Sums[f] != "" && tt.Sums[f] != sum:
			tf, err := tt.Read(f)
			if err != nil {
				return fmt.Errorf("task %s: test file %s: %w", t.ID, f, err)
			}
			r.Reverted = append(r.Reverted, f)
			tt.Files = append(tt.Files, tf)
		}
	}
	sort.Strings(r.Removed)
	sort.Strings(r.Reverted)
	return nil
}

// runScript runs a shell script in the sandbox's work tree, named name,
// with args; stdout gets its output (nil: the output goes with its stderr
// into the error of a run that fails). what says what it does, in errors.
func runScript(ctx context.Context, p sandbox.Files, sandboxID string, t *Task, what, script, name string, args []string, stdout *bytes.Buffer) error {
	var errb bytes.Buffer
	if stdout == nil {
		stdout = &errb
	}
	res, err := p.Exec(ctx, sandboxID, sandbox.ExecRequest{
		Argv: append([]string{"/bin/sh", "-c", script, name}, args...),
		Cwd:  WorkDir, Stdout: stdout, Stderr: &errb, Timeout: time.Minute,
	})
	if err != nil {
		return fmt.Errorf("task %s: %s in sandbox %s: %w", t.ID, what, sandboxID, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("task %s: %s in sandbox %s: exit %d: %s", t.ID, what, sandboxID, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// testsTar is a tar of task's test files (sorted by path, in place), with
// the directories above them.
func testsTar(task string, files []TestFile) (*bytes.Buffer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	sort.Slice(files, func(i, j int) bool { return files[i].Path < files[j].Path })
	for _, f := range files {
		if err := checkRelPath(f.Path); err != nil {
			return nil, fmt.Errorf("task %s: test file: %w", task, err)
		}
		var parents []string
		for d := path.Dir(f.Path); d != "." && !dirs[d]; d = path.Dir(d) {
			parents = append(parents, d)
			dirs[d] = true
		}
		for i := len(parents) - 1; i >= 0; i-- {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: parents[i] + "/", Mode: 0o755}); err != nil {
				return nil, err
			}
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.Path, Mode: int64(f.Mode), Size: int64(len(f.Data))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.Data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return &buf, nil
}
