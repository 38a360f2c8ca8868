package task

import "testing"

// TestGoTasksShareTheirEnvironmentsSeed: the Go tasks of one environment
// share one seed (one cold build for all of them), and another
// environment has its own.
func TestGoTasksShareTheirEnvironmentsSeed(t *testing.T) {
	a := &Task{ID: "go-a", Language: "go", TestCmd: "go test ./..."}
	b := &Task{ID: "go-b", Language: "go", TestCmd: "go test -run X ./pkg"}
	dir := t.TempDir()
	if seedPath(dir, a, "host") != seedPath(dir, b, "host") {
		t.Error("two Go tasks of one environment have seeds of their own")
	}
	if seedPath(dir, a, "host") == seedPath(dir, a, "image:sha256:0123") {
		t.Error("two environments share a seed")
	}
}
