package cli_test

import (
	"encoding/json"
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
