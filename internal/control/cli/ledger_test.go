package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/system"
	"stasis/internal/storage/ledger"
)

// envLedgerCLI makes the test binary run the stasis command line with the
// ledger command, whether or not the root registers it yet, instead of its
// tests. (stasistest cannot be used here: it imports this package.)
const envLedgerCLI = "STASIS_TEST_LEDGER_CLI"

func init() {
	if os.Getenv(envLedgerCLI) != "1" {
		return
	}
	root := newRoot()
	if c, _, err := root.Find([]string{"ledger"}); err != nil || c == root {
		root.AddCommand(newLedgerCmd())
	}
	root.SetArgs(os.Args[1:])
	err := root.Execute()
	var ee *exitError
	switch {
	case err == nil:
		os.Exit(0)
	case errors.As(err, &ee):
		if ee.Err != nil {
			fmt.Fprintln(os.Stderr, "stasis:", ee.Err)
		}
		os.Exit(ee.Code)
	}
	fmt.Fprintln(os.Stderr, "stasis:", err)
	os.Exit(1)
}

// runLedger runs "stasis ARGS" as a separate process with STASIS_HOME set
// to home and returns stdout, stderr and the exit code.
func runLedger(t *testing.T, home string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), envLedgerCLI+"=1", "STASIS_HOME="+home)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

func ledgerResp(text string) json.RawMessage {
	b, _ := json.Marshal(map[string]any{
		"prompt_token_ids": []int{1, 2, 3, 4},
		"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": text},
			"token_ids": []int{5, 6}}},
		"usage": map[string]any{"prompt_tokens": 4, "completion_tokens": 2},
	})
	return b
}

// writeLedger makes a ledger with three calls (the first two settled
// delivered), a restore cut to 2, a re-issued call 3 (abandoned), a
// relaunch that matched, and a call after it (pending).
func writeLedger(t *testing.T, dir, ep string) {
	t.Helper()
	l, err := ledger.Open(dir, ep)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	start := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	add := func(n, attempt int, text string) {
		_, err := l.Append(ledger.Entry{
			CallID: fmt.Sprintf("%s/%d", ep, n), Attempt: attempt,
			Request:  json.RawMessage(`{"model":"m"}`),
			Response: ledgerResp(text), Usage: json.RawMessage(`{"prompt_tokens":4,"completion_tokens":2}`),
			Started: start.Add(time.Duration(n) * time.Second), Finished: start.Add(time.Duration(n)*time.Second + 250*time.Millisecond),
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	settle := func(ss ...ledger.Settlement) {
		if err := l.Settle(ss...); err != nil {
			t.Fatal(err)
		}
	}
	add(1, 1, "one")
	add(2, 1, "two")
	settle(ledger.Settlement{Seq: 1, CallID: ep + "/1", Disposition: ledger.Delivered}, ledger.Settlement{Seq: 2, CallID: ep + "/2", Disposition: ledger.Delivered})
	add(3, 1, "three")
	if err := l.Cut(2, "restore of ckpt-000001: relay_delivered 2"); err != nil {
		t.Fatal(err)
	}
	add(3, 2, "three again")
	settle(ledger.Settlement{Seq: 3, CallID: ep + "/3", Disposition: ledger.Abandoned})
	m, err := l.Match([]json.RawMessage{
		json.RawMessage(`{"role":"user","content":"go"}`),
		json.RawMessage(`{"role":"assistant","content":"one"}`),
		json.RawMessage(`{"role":"assistant","content":"two"}`),
	})
	if err != nil || m.Position != 2 {
		t.Fatalf("match: %+v %v", m, err)
	}
	add(3, 3, "three, relaunched")
}

func TestLedgerShow(t *testing.T) {
	home := t.TempDir()
	writeLedger(t, filepath.Join(home, "ledgers"), "ep1")
	out, errOut, code := runLedger(t, home, "ledger", "show", "ep1")
	if code != 0 {
		t.Fatalf("exit %d: %s %s", code, out, errOut)
	}
	for _, want := range []string{
		"format 2)",
		"3 live entries (2 delivered, 1 pending), 5 recorded, 2 dropped by cuts, 2 events; history intact",
		"SEQ  CALL ID", "PROMPT TOK", "BOUNDARY", "DISPOSITION",
		"dropped by cuts (1 abandoned, 1 undelivered):",
		"cut 3 -> 2 entries: restore of ckpt-000001",
		"cut 3 -> 2 entries: relaunch", "the next entry is a boundary",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}
	var rows []string
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 10 && (f[1] == "ep1/1" || f[1] == "ep1/3") {
			rows = append(rows, strings.Join(f, " "))
		}
	}
	if len(rows) != 4 || !strings.HasPrefix(rows[0], "1 ep1/1 1 2026-03-01T12:00:01.000Z 250 4 2 - delivered ") ||
		!strings.HasPrefix(rows[1], "3 ep1/3 3 2026-03-01T12:00:03.000Z 250 4 2 yes pending ") ||
		!strings.HasPrefix(rows[2], "3 ep1/3 1 2026-03-01T12:00:03.000Z 250 4 2 - undelivered ") ||
		!strings.HasPrefix(rows[3], "3 ep1/3 2 2026-03-01T12:00:03.000Z 250 4 2 - abandoned ") {
		t.Fatalf("rows %q:\n%s", rows, out)
	}

	out, _, code = runLedger(t, home, "ledger", "show", "ep1", "--json")
	var h ledger.History
	if code != 0 || json.Unmarshal([]byte(out), &h) != nil || len(h.Entries) != 3 || h.Total != 5 || len(h.Events) != 2 || !h.Entries[2].Boundary || h.Entries[2].Tokens == nil ||
		h.Format != 2 || h.Entries[0].Disposition != ledger.Delivered || h.Entries[2].Disposition != ledger.Pending ||
		len(h.Dropped) != 2 || h.Dropped[0].Disposition != ledger.Undelivered || h.Dropped[1].Disposition != ledger.Abandoned || h.Dropped[1].Attempt != 2 {
		t.Fatalf("show --json: exit %d\n%s", code, out)
	}
	if !strings.Contains(out, `"disposition": "abandoned"`) {
		t.Fatalf("show --json has no disposition:\n%s", out)
	}

	// --dir instead of $STASIS_HOME/ledgers.
	other := t.TempDir()
	writeLedger(t, other, "ep2")
	if out, _, code = runLedger(t, home, "ledger", "show", "ep2", "--dir", other); code != 0 || !strings.Contains(out, "ledger ep2") {
		t.Fatalf("--dir: exit %d\n%s", code, out)
	}

	// --state: a stasis serve's state directory, its ledgers where it
	// keeps them (system.LedgerDir); not with --dir, and not a missing one.
	state := t.TempDir()
	writeLedger(t, system.LedgerDir(state), "ep3")
	if out, _, code = runLedger(t, home, "ledger", "verify", "ep3", "--state", state); code != 0 || !strings.HasPrefix(out, "OK "+filepath.Join(state, "gateway", "ledgers", "ep3.ledger")) {
		t.Fatalf("--state: exit %d\n%s", code, out)
	}
	if _, errOut, code := runLedger(t, home, "ledger", "show", "ep3", "--state", state, "--dir", other); code != 2 || !strings.Contains(errOut, "not both") {
		t.Fatalf("--state with --dir: exit %d %s", code, errOut)
	}
	if _, errOut, code := runLedger(t, home, "ledger", "show", "ep3", "--state", filepath.Join(state, "nope")); code != 2 || !strings.Contains(errOut, "not a directory") {
		t.Fatalf("--state missing: exit %d %s", code, errOut)
	}
}

func TestLedgerVerify(t *testing.T) {
	home := t.TempDir()
	dir := filepath.Join(home, "ledgers")
	writeLedger(t, dir, "ep1")
	out, errOut, code := runLedger(t, home, "ledger", "verify", "ep1")
	if code != 0 || !strings.HasPrefix(out, "OK ") || !strings.Contains(out, "10 records, 5 entries (3 live), 2 cuts; 2 delivered, 1 abandoned, 1 pending, 1 undelivered") {
		t.Fatalf("verify: exit %d\n%s%s", code, out, errOut)
	}
	out, _, code = runLedger(t, home, "ledger", "verify", "ep1", "--json")
	var ok ledger.Report
	if code != 0 || json.Unmarshal([]byte(out), &ok) != nil || !ok.OK || ok.Format != 2 || ok.Delivered != 2 || ok.Abandoned != 1 || ok.Pending != 1 || ok.Undelivered != 1 {
		t.Fatalf("verify --json: exit %d\n%s", code, out)
	}
	// Change one byte of entry 2's response (line 3).
	path := filepath.Join(dir, "ep1.ledger")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, bytes.Replace(data, []byte(`"content":"two"`), []byte(`"content":"twO"`), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = runLedger(t, home, "ledger", "verify", "ep1")
	if code != 2 || !strings.Contains(out, "FAILED") || !strings.Contains(out, "line 3 (seq 2): hash mismatch") || !strings.Contains(errOut, "damaged at line 3") {
		t.Fatalf("damaged: exit %d\n%s%s", code, out, errOut)
	}
	out, _, code = runLedger(t, home, "ledger", "verify", "ep1", "--json")
	var rep ledger.Report
	if code != 2 || json.Unmarshal([]byte(out), &rep) != nil || rep.OK || rep.Bad == nil || rep.Bad.Line != 3 || rep.Bad.Seq != 2 {
		t.Fatalf("damaged --json: exit %d\n%s", code, out)
	}
	if _, errOut, code = runLedger(t, home, "ledger", "show", "ep1"); code != 2 || !strings.Contains(errOut, "line 3") {
		t.Fatalf("show damaged: exit %d %s", code, errOut)
	}
}

func TestLedgerErrors(t *testing.T) {
	home := t.TempDir()
	cases := []struct {
		args []string
		code int
		says string
	}{
		{[]string{"ledger", "verify", "nope"}, 1, `no ledger for episode "nope"`},
		{[]string{"ledger", "show", "nope"}, 1, `no ledger for episode "nope"`},
		{[]string{"ledger", "verify", "../etc"}, 2, "episode name"},
		{[]string{"ledger", "show"}, 2, "takes one episode name"},
		{[]string{"ledger", "verify", "a", "b"}, 2, "takes one episode name"},
	}
	for _, c := range cases {
		_, errOut, code := runLedger(t, home, c.args...)
		if code != c.code || !strings.Contains(errOut, c.says) {
			t.Errorf("stasis %v: exit %d, stderr %q; want exit %d saying %q", c.args, code, errOut, c.code, c.says)
		}
	}
	out, _, code := runLedger(t, home, "ledger", "verify", "nope", "--json")
	var doc map[string]string
	if code != 1 || json.Unmarshal([]byte(out), &doc) != nil || doc["code"] != "not_found" {
		t.Fatalf("--json not found: exit %d %s", code, out)
	}
}
