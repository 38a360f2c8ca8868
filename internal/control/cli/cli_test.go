package cli_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/insandbox/supervisor"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// stasis runs the command line as a separate process and returns its
// stdout, stderr and exit code.
func stasis(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	return stasistest.Run(t, nil, "", args...)
}

func TestHelpListsEverySubcommand(t *testing.T) {
	out, _, code := stasis(t, "--help")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, sub := range []string{"supervise", "ctl", "demo", "bench", "version"} {
		if !strings.Contains(out, "  "+sub+" ") {
			t.Errorf("--help does not list %s:\n%s", sub, out)
		}
	}
	out, _, code = stasis(t, "version")
	if code != 0 || !strings.HasPrefix(out, "stasis ") {
		t.Fatalf("version: %q %d", out, code)
	}
}

func TestUsageErrors(t *testing.T) {
	cases := []struct {
		args []string
		code int
		says string
	}{
		{[]string{"supervise", "--", "true"}, 2, "--dir is required"},
		{[]string{"supervise", "--dir", "x", "true"}, 2, "after --"},
		{[]string{"supervise", "--dir", "x", "--mode", "freeze", "--", "true"}, 2, "unknown pause mode"},
		{[]string{"supervise", "--dir", "x", "--deadline", "-1s", "--", "true"}, 2, "must not be negative"},
		{[]string{"ctl", "status"}, 2, "--dir is required"},
		{[]string{"ctl", "--dir", "x", "pause"}, 2, "needs a sequence number"},
		{[]string{"ctl", "--dir", "x", "pause", "0"}, 2, "positive integer"},
		{[]string{"ctl", "--dir", "x", "freeze"}, 2, "unknown command"},
		{[]string{"ctl", "--dir", t.TempDir(), "status"}, 1, "no supervisor"},
	}
	for _, c := range cases {
		_, errOut, code := stasis(t, c.args...)
		if code != c.code || !strings.Contains(errOut, c.says) {
			t.Errorf("stasis %v: exit %d, stderr %q; want exit %d saying %q", c.args, code, errOut, c.code, c.says)
		}
	}
}

func TestCtlPrintsJSONAndRefusesWithExit2(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	c, err := supervisor.Spawn(context.Background(), supervisor.SpawnOptions{
		Exe: os.Args[0], Env: stasistest.Env, Dir: dir,
		Flags: []string{"--log-level", "error", "--mode", "hold"}, Argv: []string{"sleep", "60"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stasistest.NoChildrenLeft(t)
	defer func() { _, _ = c.Stop(context.Background(), 30*time.Second) }()

	out, _, code := stasis(t, "ctl", "--dir", dir, "pause", "1")
	var ack supervisor.Ack
	if code != 0 || json.Unmarshal([]byte(out), &ack) != nil || ack.Seq != 1 || ack.Mode != "hold" || !ack.Confirmed {
		t.Fatalf("pause 1: exit %d, %s", code, out)
	}
	var doc map[string]any
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"seq", "op", "mode", "identity", "wall", "uptime", "confirmed"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("acknowledgement lacks %q: %s", k, out)
		}
	}
	out, errOut, code := stasis(t, "ctl", "--dir", dir, "continue", "7")
	if code != 2 || !strings.Contains(errOut, "the pause in force is 1") || json.Unmarshal([]byte(out), &doc) != nil || doc["code"] != "refused" {
		t.Fatalf("continue 7: exit %d, stdout %s, stderr %s", code, out, errOut)
	}
	out, _, code = stasis(t, "ctl", "--dir", dir, "continue", "1")
	if code != 0 || !strings.Contains(out, `"relaunched": false`) {
		t.Fatalf("continue 1: exit %d, %s", code, out)
	}
	out, _, code = stasis(t, "ctl", "--dir", dir, "status")
	var st supervisor.Status
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil || st.State != "running" || st.Seq != 1 || st.Identity.PID != c.Cmd.Process.Pid {
		t.Fatalf("status: exit %d, %s", code, out)
	}
	out, _, code = stasis(t, "ctl", "--dir", dir, "stop")
	var rc supervisor.Receipt
	if code != 0 || json.Unmarshal([]byte(out), &rc) != nil || !rc.Stopped || !rc.CleanupConfirmed {
		t.Fatalf("stop: exit %d, %s", code, out)
	}
	if err := c.Wait(10 * time.Second); err != nil {
		// A harness ended by SIGTERM makes the supervisor exit 143: fine.
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 143 {
			t.Fatalf("supervisor exit: %v", err)
		}
	}
	out, errOut, code = stasis(t, "ctl", "--dir", dir, "pause", "2")
	if code != 2 || !strings.Contains(errOut, "has exited") {
		t.Fatalf("pause after exit: exit %d, %s %s", code, out, errOut)
	}
}

func TestDemoShowsBothModes(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	out, errOut, code := stasis(t, "demo")
	if code != 0 {
		t.Fatalf("demo exit %d\n%s\n%s", code, out, errOut)
	}
	var stopLine, holdLine string
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) > 2 && f[1] == "pause" {
			switch f[0] {
			case "stop":
				stopLine = l
			case "hold":
				holdLine = l
			}
		}
	}
	if !strings.Contains(stopLine, "still (0 B)") || !strings.Contains(holdLine, "grew") {
		t.Fatalf("demo table does not show a frozen stop pause and a running hold pause:\n%s", out)
	}
	if strings.Count(out, "cleanup_confirmed=true") != 2 {
		t.Fatalf("demo receipts:\n%s", out)
	}
	stasistest.NoChildrenLeft(t)
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Fatalf("demo left %v in TMPDIR", left)
	}
}
