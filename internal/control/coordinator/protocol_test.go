package coordinator_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// modelVariants are the checks of protocol.pml: the model as it is, which
// must hold every invariant, and each BROKEN_ variant with the invariant
// (the monitor's flag) it must violate.
var modelVariants = []struct {
	define   string // spin -D; "" for the model as it is
	violates string // "" for none
}{
	{"", ""},
	{"BROKEN_COMMIT_BEFORE_RECORDS", "restorable"},
	{"BROKEN_CUT_AFTER_DELIVERY", "cutreceived"},
	{"BROKEN_NO_RECOVERY_GC", "noleak"},
	{"BROKEN_NO_SNAPSHOT_GC", "noleak"},
	{"BROKEN_NO_FORK_GC", "noleak"},
	{"BROKEN_CUT_BY_POSITION", "cutreceived"},
}

// modelTimeout bounds each spin, gcc and pan run.
const modelTimeout = 3 * time.Minute

var (
	panErrors   = regexp.MustCompile(`errors: (\d+)`)
	panViolated = regexp.MustCompile(`assertion violated (\w+) \(at depth`)
	panStates   = regexp.MustCompile(`(\d+) states, stored`)
	panElapsed  = regexp.MustCompile(`pan: elapsed time ([0-9.e+]+) seconds`)
)

// TestProtocolModel checks the Promela model of the checkpoint protocol
// (protocol.pml) exhaustively with spin: with every invariant holding, no
// assertion failing and no invalid end state (a deadlock); and that each
// deliberately broken variant makes spin report a violation of the
// invariant it breaks.
func TestProtocolModel(t *testing.T) {
	spin, err := exec.LookPath("spin")
	if err != nil {
		t.Fatalf("spin (Debian package spin) is not on $PATH: %v; run `make deps`, which installs it", err)
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Fatalf("gcc is needed to compile spin's verifier: %v; run `make deps`, which installs it", err)
	}
	model, err := os.ReadFile("protocol.pml")
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range modelVariants {
		name := v.define
		if name == "" {
			name = "sound"
		}
		t.Run(name, func(t *testing.T) {
			out, replay := verifyModel(t, spin, gcc, model, v.define)
			m := panErrors.FindStringSubmatch(out)
			if m == nil {
				t.Fatalf("pan printed no error count:\n%s", out)
			}
			errs, _ := strconv.Atoi(m[1])
			states, elapsed := "?", "?"
			if m := panStates.FindStringSubmatch(out); m != nil {
				states = m[1]
			}
			if m := panElapsed.FindStringSubmatch(out); m != nil {
				elapsed = m[1]
			}
			if v.violates == "" {
				if errs != 0 || strings.Contains(out, "invalid end state (") || strings.Contains(out, "violated") {
					t.Fatalf("spin found %d errors in the model:\n%s\n%s", errs, out, replay())
				}
				for _, bad := range []string{"max search depth too small", "out of memory", "Search not completed"} {
					if strings.Contains(out, bad) {
						t.Fatalf("the search was not exhaustive (%s):\n%s", bad, out)
					}
				}
				if !strings.Contains(out, "invalid end states\t+") || !strings.Contains(out, "assertion violations\t+") {
					t.Fatalf("pan did not check assertions and end states:\n%s", out)
				}
				t.Logf("errors: 0, %s states, %s s", states, elapsed)
				return
			}
			got := panViolated.FindStringSubmatch(out)
			if errs == 0 || got == nil {
				t.Fatalf("-D%s: spin found no violation of %s (errors: %d):\n%s", v.define, v.violates, errs, out)
			}
			if got[1] != v.violates {
				t.Fatalf("-D%s: spin reports a violation of %s, want %s:\n%s\n%s", v.define, got[1], v.violates, out, replay())
			}
			t.Logf("%s violated as expected: %s states, %s s", v.violates, states, elapsed)
		})
	}
}

// verifyModel runs spin -a on the model with define (if any), compiles the
// verifier and runs an exhaustive safety search (assertions, invalid end
// states), all in a temporary directory. It returns pan's output, and a
// function that replays the error trail pan wrote (the end of it).
func verifyModel(t *testing.T, spin, gcc string, model []byte, define string) (string, func() string) {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "protocol.pml"), model, 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(name string, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), modelTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			err = fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out), err
	}
	must := func(name string, args ...string) string {
		t.Helper()
		out, err := run(name, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	var defines []string
	if define != "" {
		defines = append(defines, "-D"+define)
	}
	must(spin, append(append([]string{"-a"}, defines...), "protocol.pml")...)
	// SAFETY: no cycle search (the model's invariants are safety
	// properties); COLLAPSE: compressed states; MEMLIM: at most 512 MB.
	// A broken variant fails within a few thousand states, so its
	// verifier is not worth optimising.
	opt := "-O2"
	if define != "" {
		opt = "-O0"
	}
	must(gcc, opt, "-w", "-DSAFETY", "-DCOLLAPSE", "-DMEMLIM=512", "-o", "pan", "pan.c")
	// -m: search depth (the model's deepest path is about 110 steps);
	// -w20: a hash table of 2^20 slots, grown when needed.
	out := must(filepath.Join(dir, "pan"), "-m10000", "-w20")
	replay := func() string {
		trail, err := run(spin, append(append([]string{"-t", "-p"}, defines...), "protocol.pml")...)
		if err != nil {
			return err.Error()
		}
		lines := strings.Split(trail, "\n")
		if len(lines) > 150 {
			lines = append([]string{"..."}, lines[len(lines)-150:]...)
		}
		return "the trail:\n" + strings.Join(lines, "\n")
	}
	return out, replay
}
