package serve_test

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/serve"
	"stasis/internal/testwait"
)

// The step gate stops at the first step its filter names, marks it
// reached and goes on once the .go file is there; every other step, and
// the same step again, passes at once. A filter that is not OP:STEP is
// refused, naming the variable and the form.
func TestStepGate(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir := t.TempDir()
	t.Setenv(serve.StepGateEnv, dir)
	t.Setenv(serve.StepGateAtEnv, "commit")
	if _, err := serve.StepGateFromEnv(log); err == nil || !strings.Contains(err.Error(), serve.StepGateAtEnv) || !strings.Contains(err.Error(), "OP:STEP") {
		t.Fatalf("a bad filter: %v", err)
	}
	t.Setenv(serve.StepGateAtEnv, "prepare:commit")
	g, err := serve.StepGateFromEnv(log)
	if err != nil || g == nil {
		t.Fatal(g, err)
	}
	if err := g.Step("prepare", "pause", "ep-1"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Step("prepare", "commit", "") }()
	reached := filepath.Join(dir, "1-prepare-commit-.reached")
	testwait.Until(t, "the gate to mark the step reached", time.Minute, func() bool {
		_, err := os.Stat(reached)
		return err == nil
	})
	select {
	case err := <-done:
		t.Fatalf("the gate went on before its .go file: %v", err)
	default:
	}
	if err := os.WriteFile(strings.TrimSuffix(reached, ".reached")+".go", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := g.Step("prepare", "commit", ""); err != nil { // once only
		t.Fatal(err)
	}
	if ms, _ := filepath.Glob(filepath.Join(dir, "*.reached")); len(ms) != 1 {
		t.Fatalf("reached: %v", ms)
	}
	t.Setenv(serve.StepGateEnv, "")
	if g, err := serve.StepGateFromEnv(log); g != nil || err != nil {
		t.Fatalf("no gate asked for: %v %v", g, err)
	}
}
