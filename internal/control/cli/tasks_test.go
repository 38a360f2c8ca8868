package cli_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTasksCommand(t *testing.T) {
	out, _, code := stasis(t, "tasks", "ls")
	if code != 0 || !strings.Contains(out, "go-lru-get-recency") || !strings.Contains(out, "12 tasks") {
		t.Fatalf("tasks ls: exit %d\n%s", code, out)
	}
	out, _, code = stasis(t, "tasks", "ls", "--json")
	var rows []map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &rows) != nil || len(rows) != 12 || rows[0]["has_solution"] != true {
		t.Fatalf("tasks ls --json: exit %d\n%s", code, out)
	}
	out, _, code = stasis(t, "tasks", "show", "sh-renext-spaces")
	if code != 0 || !strings.Contains(out, "holiday photo.jpeg") || !strings.Contains(out, "sh tests.sh") {
		t.Fatalf("tasks show: exit %d\n%s", code, out)
	}
	_, errOut, code := stasis(t, "tasks", "show", "nope")
	if code != 2 || !strings.Contains(errOut, `no task "nope"`) {
		t.Fatalf("tasks show nope: exit %d %s", code, errOut)
	}
	_, errOut, code = stasis(t, "tasks", "ls", "--tasks", "/does/not/exist")
	if code != 2 || !strings.Contains(errOut, "/does/not/exist") {
		t.Fatalf("tasks ls of a missing path: exit %d %s", code, errOut)
	}
}

// A task file that loads nothing is an error, and with --strict so is one
// that loads only some; every reason goes to stderr.
func TestTasksLsFailures(t *testing.T) {
	dir := t.TempDir()
	repos := filepath.Join(dir, "repos")
	if err := os.Mkdir(repos, 0o755); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(dir, "bad.jsonl")
	rows := `{"instance_id":"a__b-1","repo":"a/b","base_commit":"abcdef1","problem_statement":"p","FAIL_TO_PASS":"[\"x\"]"}` + "\n" + `{"instance_id": "broken` + "\n"
	if err := os.WriteFile(bad, []byte(rows), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := stasis(t, "tasks", "ls", "--tasks", bad, "--repos", repos)
	if code != 2 || !strings.Contains(errOut, "repository a/b is not here") || !strings.Contains(errOut, "not a SWE-bench instance") || !strings.Contains(errOut, "no task could be loaded") || strings.Contains(out, "0 tasks") {
		t.Fatalf("tasks ls of a file that loads nothing: exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	// A directory of task directories, one of them broken: listed, exit 0;
	// with --strict, exit 2.
	tasks := filepath.Join(dir, "tasks")
	good := filepath.Join(tasks, "good")
	broken := filepath.Join(tasks, "broken")
	for _, d := range []string{filepath.Join(good, "repo"), filepath.Join(broken, "repo")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	def := `{"id":"%s","statement":"s","test_cmd":"sh t.sh","parser":"lines","fail_to_pass":["a"],"test_files":["t.sh"]}`
	for _, f := range []struct{ path, body string }{
		{filepath.Join(good, "task.json"), strings.Replace(def, "%s", "good", 1)},
		{filepath.Join(good, "repo", "t.sh"), "echo PASS: a\n"},
		{filepath.Join(broken, "task.json"), strings.Replace(def, "%s", "broken", 1)}, // t.sh is missing
	} {
		if err := os.WriteFile(f.path, []byte(f.body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, errOut, code = stasis(t, "tasks", "ls", "--tasks", tasks)
	if code != 0 || !strings.Contains(out, "1 tasks") || !strings.Contains(errOut, "t.sh is not in the work tree") {
		t.Fatalf("tasks ls with one broken task: exit %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	_, errOut, code = stasis(t, "tasks", "ls", "--tasks", tasks, "--strict")
	if code != 2 || !strings.Contains(errOut, "t.sh is not in the work tree") || !strings.Contains(errOut, "--strict") {
		t.Fatalf("tasks ls --strict with one broken task: exit %d\nstderr %s", code, errOut)
	}
}
