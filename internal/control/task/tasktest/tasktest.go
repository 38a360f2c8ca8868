// Package tasktest holds what tests of tasks share: a SWE-bench instance
// over a small repository made on the spot, laid out as SWE-bench's
// repositories are.
package tasktest

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// SWEBenchRepo makes a repository (acme/calc, instance acme__calc-7) laid out as the SWE-bench repositories are
// (a src/ package installed with pyproject.toml, tests under tests/), and
// an instance row in the published datasets' form, without test_cmd or
// parser: the harness's command and parser apply. The test patch also
// adds a .toml fixture, which the harness leaves out of the command.
func SWEBenchRepo(t testing.TB) (jsonl, repos string) {
	t.Helper()
	repos = t.TempDir()
	repo := filepath.Join(repos, "acme__calc")
	for _, d := range []string{"src/acmecalc", "tests/data"} {
		if err := os.MkdirAll(filepath.Join(repo, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	Git(t, repo, "init", "-q", "-b", "main")
	Write(t, repo, "pyproject.toml", "[build-system]\nrequires = [\"setuptools\"]\nbuild-backend = \"setuptools.build_meta\"\n\n[project]\nname = \"acmecalc\"\nversion = \"1.0\"\n\n[tool.setuptools.packages.find]\nwhere = [\"src\"]\n")
	Write(t, repo, "src/acmecalc/__init__.py", "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
	Write(t, repo, "tests/test_calc.py", "import acmecalc\n\n\ndef test_mul():\n    assert acmecalc.mul(2, 3) == 6\n")
	Write(t, repo, "tests/conftest.py", "import pytest\n")
	Git(t, repo, "add", ".")
	Git(t, repo, "commit", "-qm", "calc")
	base := Git(t, repo, "rev-parse", "HEAD")
	Write(t, repo, "src/acmecalc/__init__.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n")
	patch := Git(t, repo, "diff") + "\n"
	Git(t, repo, "checkout", "-q", ".")
	Write(t, repo, "tests/test_calc.py", "import acmecalc\n\n\ndef test_mul():\n    assert acmecalc.mul(2, 3) == 6\n\n\ndef test_add():\n    assert acmecalc.add(2, 3) == 5\n")
	Write(t, repo, "tests/data/cases.toml", "[add]\ncases = [[2, 3, 5]]\n")
	Git(t, repo, "add", "-N", "tests/data/cases.toml")
	testPatch := Git(t, repo, "diff") + "\n"
	Git(t, repo, "reset", "-q")
	Git(t, repo, "checkout", "-q", ".")
	if err := os.RemoveAll(filepath.Join(repo, "tests/data/cases.toml")); err != nil {
		t.Fatal(err)
	}
	// The fix lands later: a full clone has it; the work tree must not.
	Write(t, repo, "src/acmecalc/__init__.py", "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n")
	Git(t, repo, "commit", "-qam", "fix add")
	row, _ := json.Marshal(map[string]any{
		"repo": "acme/calc", "instance_id": "acme__calc-7", "base_commit": base, "patch": patch, "test_patch": testPatch,
		"problem_statement": "add(2, 3) returns -1.", "hints_text": "", "created_at": "2024-01-01T00:00:00Z", "version": "1.0",
		"FAIL_TO_PASS": `["tests/test_calc.py::test_add"]`, "PASS_TO_PASS": `["tests/test_calc.py::test_mul"]`,
		"environment_setup_commit": base,
	})
	jsonl = filepath.Join(t.TempDir(), "rows.jsonl")
	Write(t, filepath.Dir(jsonl), filepath.Base(jsonl), string(row)+"\n")
	return jsonl, repos
}

// Git runs git in dir with a fixed identity and no user configuration,
// and returns its trimmed output; a failure fails the test.
func Git(t testing.TB, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
		"GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@localhost", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@localhost")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}

// Write writes a file under dir; a failure fails the test.
func Write(t testing.TB, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// NeedPythonEnv skips a test on a machine without what SWE-bench
// environments are built from (make deps-test installs it).
func NeedPythonEnv(t testing.TB) {
	t.Helper()
	for _, p := range []string{"/usr/bin/python3", "/usr/bin/bwrap"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("%s is missing (make deps-test installs it)", p)
		}
	}
	if err := exec.Command("/usr/bin/python3", "-c", "import pytest, setuptools, pip").Run(); err != nil {
		t.Skip("Debian's python3-pytest, python3-setuptools or python3-pip is missing (make deps-test installs them)")
	}
}
