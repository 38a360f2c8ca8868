package main_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fixedLines are, per built-in task, the lines its reference solution adds
// to the work tree: what an agent would grep a binary for.
func fixedLines(t *testing.T) map[string][]string {
	t.Helper()
	root := filepath.Join("..", "..", "internal", "control", "task", "_builtin")
	tasks, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, e := range tasks {
		sol := filepath.Join(root, e.Name(), "solution")
		err := filepath.WalkDir(sol, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, _ := filepath.Rel(sol, p)
			fixed, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			orig, _ := os.ReadFile(filepath.Join(root, e.Name(), "repo", rel))
			have := map[string]bool{}
			for _, l := range strings.Split(string(orig), "\n") {
				have[strings.TrimSpace(l)] = true
			}
			for _, l := range strings.Split(string(fixed), "\n") {
				if l = strings.TrimSpace(l); len(l) >= 12 && !have[l] {
					out[e.Name()] = append(out[e.Name()], l)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(out) < 10 {
		t.Fatalf("found fixed lines for only %d built-in tasks: the layout of internal/control/task/_builtin changed", len(out))
	}
	return out
}

func build(t *testing.T, pkg, out string) []byte {
	t.Helper()
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestNoReferenceSolutions acts as an agent that greps the stasis binary in
// its sandbox for the fixed line of its task: the lean in-sandbox binary
// must hold none of them. The full binary is probed the same way, to show
// that the probe finds them where they are.
func TestNoReferenceSolutions(t *testing.T) {
	if testing.Short() {
		t.Skip("builds two binaries")
	}
	lines := fixedLines(t)
	dir := t.TempDir()
	lean := build(t, "stasis/cmd/stasis-sandbox", filepath.Join(dir, "stasis-sandbox"))
	full := build(t, "stasis/cmd/stasis", filepath.Join(dir, "stasis"))
	for task, ls := range lines {
		inFull := 0
		for _, l := range ls {
			if bytes.Contains(lean, []byte(l)) {
				t.Errorf("task %s: the in-sandbox binary holds its reference solution's line %q", task, l)
			}
			if bytes.Contains(full, []byte(l)) {
				inFull++
			}
		}
		if inFull == 0 {
			t.Errorf("task %s: none of its %d fixed lines found in the full binary either: the probe does not work", task, len(ls))
		}
	}
}

// TestLeanImports keeps the packages that hold task data, the scripted
// model and the host's machinery out of the in-sandbox binary.
func TestLeanImports(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "stasis/cmd/stasis-sandbox").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range strings.Fields(string(out)) {
		switch {
		case p == "stasis/internal/control/task", strings.HasPrefix(p, "stasis/internal/control/task/"), p == "stasis/internal/control/model", strings.HasPrefix(p, "stasis/internal/control/model/"),
			p == "stasis/internal/control/cli", p == "stasis/internal/control/server", p == "stasis/internal/control/coordinator", p == "stasis/internal/control/episode", p == "stasis/internal/storage/store":
			t.Errorf("the in-sandbox binary imports %s", p)
		}
	}
}
