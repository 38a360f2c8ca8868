package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"stasis/internal/testsvc"
	"strings"
	"sync"
	"testing"
	"time"
)

// chat returns a chat-completions response whose message has content and,
// for each name/arguments pair, a tool call.
func chat(content string, calls ...string) json.RawMessage {
	msg := map[string]any{"role": "assistant", "content": content}
	var tcs []any
	for i := 0; i+1 < len(calls); i += 2 {
		tcs = append(tcs, map[string]any{"id": fmt.Sprintf("call_%d", i), "type": "function",
			"function": map[string]any{"name": calls[i], "arguments": calls[i+1]}})
	}
	if tcs != nil {
		msg["tool_calls"] = tcs
	}
	b, _ := json.Marshal(map[string]any{"id": "chatcmpl-1", "object": "chat.completion",
		"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": "stop"}}})
	return b
}

func msg(role, content string) json.RawMessage {
	b, _ := json.Marshal(map[string]any{"role": role, "content": content})
	return b
}

func entry(id string, resp json.RawMessage) Entry {
	now := time.Now().UTC()
	return Entry{CallID: id, Attempt: 1, Request: json.RawMessage(`{"model":"m","messages":[]}`),
		Response: resp, Started: now, Finished: now.Add(5 * time.Millisecond)}
}

func open(t testing.TB, dir, ep string) *Ledger {
	t.Helper()
	l, err := Open(dir, ep)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func mustAppend(t testing.TB, l *Ledger, e Entry) Entry {
	t.Helper()
	got, err := l.Append(e)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func seqs(es []Entry) string {
	var s []string
	for _, e := range es {
		s = append(s, fmt.Sprintf("%d:%s", e.Seq, e.CallID))
	}
	return strings.Join(s, " ")
}

func TestAppendReopenRoundTrip(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep1")
	var want []Entry
	for i := 1; i <= 3; i++ {
		e := entry(fmt.Sprintf("ep1/%d", i), chat(fmt.Sprintf("answer %d", i)))
		e.Usage = json.RawMessage(`{"prompt_tokens": 10, "completion_tokens": 3}`)
		got := mustAppend(t, l, e)
		if got.Seq != int64(i) || len(got.Hash) != 64 || got.Parent == "" {
			t.Fatalf("append %d: %+v", i, got)
		}
		if i > 1 && got.Parent != want[i-2].Hash {
			t.Fatalf("append %d: parent %s, want previous hash %s", i, got.Parent, want[i-2].Hash)
		}
		want = append(want, got)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2 := open(t, dir, "ep1")
	got := l2.Entries()
	if len(got) != 3 {
		t.Fatalf("reopened: %d entries", len(got))
	}
	for i := range got {
		a, _ := json.Marshal(got[i])
		b, _ := json.Marshal(want[i])
		if !bytes.Equal(a, b) {
			t.Errorf("entry %d after reopen:\n%s\nwant\n%s", i+1, a, b)
		}
	}
	e := mustAppend(t, l2, entry("ep1/4", chat("four")))
	if e.Seq != 4 || e.Parent != want[2].Hash {
		t.Fatalf("append after reopen: %+v", e)
	}
	rep, err := Verify(dir, "ep1")
	if err != nil || !rep.OK || rep.Records != 5 || rep.Live != 4 || rep.Entries != 4 || rep.Head != e.Hash {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	// The file is JSON lines, the header first.
	data, _ := os.ReadFile(filepath.Join(dir, "ep1.ledger"))
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if len(lines) != 5 || !strings.HasPrefix(lines[0], `{"kind":"ledger","format":2,"episode":"ep1"`) || !strings.HasPrefix(lines[1], `{"kind":"entry","seq":1,"call_id":"ep1/1"`) {
		t.Fatalf("file:\n%s", data)
	}
}

func TestAppendValidates(t *testing.T) {
	l := open(t, t.TempDir(), "ep")
	for _, c := range []struct {
		e    Entry
		says string
	}{
		{Entry{Response: chat("x")}, "empty call id"},
		{Entry{CallID: "ep/1"}, "no response"},
		{Entry{CallID: "ep/1", Response: json.RawMessage(`{"x":`)}, "not valid JSON"},
		{Entry{CallID: "ep/1", Response: chat("x"), Request: json.RawMessage(`nope`)}, "request of ep/1 is not valid JSON"},
	} {
		if _, err := l.Append(c.e); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("append %+v: %v, want %q", c.e, err, c.says)
		}
	}
	mustAppend(t, l, entry("ep/1", chat("x")))
	if _, err := l.Append(entry("ep/1", chat("x"))); !errors.Is(err, ErrDuplicate) || !strings.Contains(err.Error(), "seq 1") {
		t.Fatalf("duplicate call id: %v", err)
	}
	if l.Len() != 1 {
		t.Fatalf("len %d", l.Len())
	}
}

func TestConcurrentAppends(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	const workers, each = 8, 10
	var wg sync.WaitGroup
	errs := make(chan error, workers*each)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				id := fmt.Sprintf("ep/%d-%d", w, i)
				if _, err := l.Append(entry(id, chat(id))); err != nil {
					errs <- err
				}
				l.Lookup(id)
				l.Len()
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	es := l.Entries()
	if len(es) != workers*each {
		t.Fatalf("%d entries", len(es))
	}
	for i, e := range es {
		if e.Seq != int64(i+1) {
			t.Fatalf("entry %d has seq %d", i, e.Seq)
		}
	}
	l.Close()
	if rep, err := Verify(dir, "ep"); err != nil || !rep.OK || rep.Live != workers*each {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

// The child half of TestSecondProcessCannotAppend: open the ledger named
// by the environment and append, reporting the outcome on stdout.
func TestMain(m *testing.M) {
	if spec := os.Getenv("LEDGER_TEST_CHILD"); spec != "" {
		dir, ep, _ := strings.Cut(spec, "|")
		l, err := Open(dir, ep)
		if err != nil {
			fmt.Println("open:", err)
			os.Exit(3)
		}
		if _, err := l.Append(entry(ep+"/child", chat("from the child"))); err != nil {
			fmt.Println("append:", err)
			os.Exit(4)
		}
		l.Close()
		fmt.Println("appended")
		os.Exit(0)
	}
	testsvc.Main(m)
}

func child(t *testing.T, dir, ep string) (string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "LEDGER_TEST_CHILD="+dir+"|"+ep)
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), code
}

func TestSecondProcessCannotAppend(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	mustAppend(t, l, entry("ep/1", chat("one")))
	out, code := child(t, dir, "ep")
	if code != 3 || !strings.Contains(out, "another process") {
		t.Fatalf("child while the lock is held: exit %d: %s", code, out)
	}
	// A second Open in this process is refused too.
	if _, err := Open(dir, "ep"); !errors.Is(err, ErrLocked) {
		t.Fatalf("second open in-process: %v", err)
	}
	mustAppend(t, l, entry("ep/2", chat("two")))
	l.Close()
	out, code = child(t, dir, "ep")
	if code != 0 {
		t.Fatalf("child after close: exit %d: %s", code, out)
	}
	l2 := open(t, dir, "ep")
	if got := seqs(l2.Entries()); got != "1:ep/1 2:ep/2 3:ep/child" {
		t.Fatalf("entries: %s", got)
	}
}

func TestCutThenAppendNumbering(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	for i := 1; i <= 5; i++ {
		mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprint(i))))
	}
	if err := l.Cut(2, "restore of ckpt-1: relay_delivered 2"); err != nil {
		t.Fatal(err)
	}
	if err := l.Cut(3, "x"); err == nil || !strings.Contains(err.Error(), "from 0 to 2") {
		t.Fatalf("cut past the end: %v", err)
	}
	if l.Len() != 2 {
		t.Fatalf("len after cut %d", l.Len())
	}
	// The re-issued call 3 under attempt 2 gets seq 3 again.
	e := entry("ep/3", chat("3 again"))
	e.Attempt = 2
	got := mustAppend(t, l, e)
	if got.Seq != 3 || got.Boundary {
		t.Fatalf("append after cut: %+v", got)
	}
	mustAppend(t, l, entry("ep/4", chat("4 again")))
	if s := seqs(l.Entries()); s != "1:ep/1 2:ep/2 3:ep/3 4:ep/4" {
		t.Fatalf("entries %s", s)
	}
	l.Close()
	h, err := Read(dir, "ep")
	if err != nil {
		t.Fatal(err)
	}
	if s := seqs(h.Entries); s != "1:ep/1 2:ep/2 3:ep/3 4:ep/4" || h.Total != 7 || len(h.Events) != 1 || h.Events[0].To != 2 || h.Events[0].From != 5 {
		t.Fatalf("read: %s total %d events %+v", s, h.Total, h.Events)
	}
	if h.Entries[2].Attempt != 2 || !strings.Contains(string(h.Entries[2].Response), "3 again") {
		t.Fatalf("entry 3: %+v", h.Entries[2])
	}
	// The file only grew: seven entries, a header and a cut.
	if rep, _ := Verify(dir, "ep"); !rep.OK || rep.Records != 9 || rep.Cuts != 1 {
		t.Fatalf("verify %+v", rep)
	}
}

func TestLookupFindsLiveEntriesOnly(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	a := mustAppend(t, l, entry("ep/1", chat("one")))
	mustAppend(t, l, entry("ep/2", chat("two")))
	if got, ok := l.Lookup("ep/1"); !ok || got.Hash != a.Hash {
		t.Fatalf("lookup ep/1: %+v %v", got, ok)
	}
	if err := l.Cut(1, "restore"); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Lookup("ep/2"); ok {
		t.Fatal("lookup found an entry that was cut")
	}
	if _, ok := l.Lookup("ep/9"); ok {
		t.Fatal("lookup found an entry never appended")
	}
	// After the cut, the same call id may be recorded again.
	b := mustAppend(t, l, entry("ep/2", chat("two, re-issued")))
	l.Close()
	l = open(t, dir, "ep")
	if got, ok := l.Lookup("ep/2"); !ok || got.Hash != b.Hash || got.Seq != 2 {
		t.Fatalf("lookup after reopen: %+v %v", got, ok)
	}
}

// conv builds a request's messages: a system and a user message, then for
// each response its assistant message (as a harness would store it) and a
// tool/user reply.
func conv(assistants ...json.RawMessage) []json.RawMessage {
	ms := []json.RawMessage{msg("system", "you fix bugs"), msg("user", "fix it")}
	for _, a := range assistants {
		ms = append(ms, a, msg("user", "ok"))
	}
	return ms
}

// asMessage turns a chat response into the assistant message a harness
// re-sends.
func asMessage(t *testing.T, resp json.RawMessage) json.RawMessage {
	t.Helper()
	var r struct {
		Choices []struct {
			Message json.RawMessage `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(resp, &r); err != nil {
		t.Fatal(err)
	}
	return r.Choices[0].Message
}

func ledgerWith(t *testing.T, resps ...json.RawMessage) (*Ledger, string) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	for i, r := range resps {
		mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i+1), r))
	}
	return l, dir
}

func TestMatchExactPrefix(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("b"), chat("c"), chat("d")}
	l, dir := ledgerWith(t, r...)
	m, err := l.Match(conv(asMessage(t, r[0]), asMessage(t, r[1])))
	if err != nil || m.Position != 2 || m.Start != 0 || !m.Boundary {
		t.Fatalf("match: %+v %v", m, err)
	}
	if l.Len() != 2 {
		t.Fatalf("len %d", l.Len())
	}
	// The boundary survives a reopen before the next call.
	l.Close()
	l = open(t, dir, "ep")
	e := mustAppend(t, l, entry("ep/3", chat("c2")))
	if e.Seq != 3 || !e.Boundary {
		t.Fatalf("first entry after the match: %+v", e)
	}
	if e = mustAppend(t, l, entry("ep/4", chat("d2"))); e.Boundary {
		t.Fatal("second entry after the match is a boundary too")
	}
	if b, _ := l.Broken(); b {
		t.Fatal("broken")
	}
}

func TestMatchStartOver(t *testing.T) {
	// An empty ledger and no assistant message: a fresh start.
	l, _ := ledgerWith(t)
	if m, err := l.Match(conv()); err != nil || !m.Fresh || m.Position != 0 || m.Boundary {
		t.Fatalf("fresh: %+v %v", m, err)
	}
	if e := mustAppend(t, l, entry("ep/1", chat("a"))); e.Boundary {
		t.Fatal("the first entry of a fresh start is a boundary")
	}
	// Entries, then a harness that starts over: cut to 0, boundary.
	mustAppend(t, l, entry("ep/2", chat("b")))
	m, err := l.Match(conv())
	if err != nil || m.Position != 0 || !m.Boundary || m.Fresh || l.Len() != 0 {
		t.Fatalf("start over: %+v %v len %d", m, err, l.Len())
	}
	if e := mustAppend(t, l, entry("ep/3", chat("a again"))); e.Seq != 1 || !e.Boundary {
		t.Fatalf("after start over: %+v", e)
	}
}

func TestMatchMismatchMarksBroken(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("b"), chat("c")}
	l, dir := ledgerWith(t, r...)
	_, err := l.Match(conv(asMessage(t, r[0]), asMessage(t, chat("something else"))))
	if !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "assistant message 2 differs") {
		t.Fatalf("mismatch: %v", err)
	}
	if b, why := l.Broken(); !b || !strings.Contains(why, "differs") {
		t.Fatalf("broken: %v %q", b, why)
	}
	if l.Len() != 3 {
		t.Fatalf("a failed match cut the ledger to %d", l.Len())
	}
	// More assistant messages than entries.
	_, err = l.Match(conv(asMessage(t, r[0]), asMessage(t, r[1]), asMessage(t, r[2]), asMessage(t, chat("d"))))
	if !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "only 3 entries") {
		t.Fatalf("longer than the ledger: %v", err)
	}
	// A non-empty conversation against an empty ledger is not a new start.
	l2, _ := ledgerWith(t)
	if _, err := l2.Match(conv(asMessage(t, r[0]))); !errors.Is(err, ErrBroken) {
		t.Fatalf("empty ledger: %v", err)
	}
	l.Close()
	h, err := Read(dir, "ep")
	if err != nil || !h.Broken || len(h.Events) != 2 || h.Events[0].Kind != "broken" {
		t.Fatalf("read: %+v %v", h, err)
	}
}

func TestMatchCompactedRun(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("b"), chat("c"), chat("d"), chat("e")}
	l, _ := ledgerWith(t, r...)
	// Compacted: the early turns are summarised, the last two kept.
	ms := []json.RawMessage{msg("system", "s"), msg("user", "summary of earlier work"), asMessage(t, r[2]), msg("user", "ok"), asMessage(t, r[3])}
	m, err := l.Match(ms)
	if err != nil || m.Position != 4 || m.Start != 2 || !m.Boundary || l.Len() != 4 {
		t.Fatalf("compacted: %+v %v len %d", m, err, l.Len())
	}
}

func TestMatchAmbiguousRunMarksBroken(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("run tests"), chat("b"), chat("run tests"), chat("c")}
	l, _ := ledgerWith(t, r...)
	_, err := l.Match(conv(asMessage(t, chat("run tests"))))
	if !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "at 2 places") {
		t.Fatalf("ambiguous: %v", err)
	}
	if l.Len() != 5 {
		t.Fatalf("len %d", l.Len())
	}
}

func TestMatchIgnoresKeyOrderAndWhitespace(t *testing.T) {
	resp := chat("let me look", "read_file", `{"path": "a.go", "lines": [1, 2], "opts": {"x": 1, "y": 2}}`)
	l, _ := ledgerWith(t, resp)
	// The harness re-sends it with other key order, spacing and tool-call ids.
	sent := json.RawMessage(`{
	  "content": "let me look\n",
	  "tool_calls": [{"function": {"arguments": "{\"opts\":{\"y\":2,\"x\":1},\"lines\":[1,2],\"path\":\"a.go\"}", "name": "read_file"}, "type": "function", "id": "other"}],
	  "role": "assistant"
	}`)
	if m, err := l.Match(conv(sent)); err != nil || m.Position != 1 {
		t.Fatalf("reordered: %+v %v", m, err)
	}
}

func TestMatchToolCalls(t *testing.T) {
	r := []json.RawMessage{
		chat("", "bash", `{"cmd":"ls"}`),
		chat("", "bash", `{"cmd":"ls"}`, "read_file", `{"path":"x"}`),
		chat("done"),
	}
	l, _ := ledgerWith(t, r...)
	// Same name, other arguments: no match.
	other := json.RawMessage(`{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"bash","arguments":"{\"cmd\":\"pwd\"}"}}]}`)
	if _, err := l.Match(conv(other)); !errors.Is(err, ErrBroken) {
		t.Fatalf("other arguments matched: %v", err)
	}
	// Tool results between the calls, content null: matches entries 1..2.
	ms := []json.RawMessage{msg("user", "go"),
		json.RawMessage(`{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"bash","arguments":"{\"cmd\": \"ls\"}"}}]}`),
		json.RawMessage(`{"role":"tool","tool_call_id":"a","content":"x.go"}`),
		json.RawMessage(`{"role":"assistant","content":[],"tool_calls":[{"id":"b","type":"function","function":{"name":"bash","arguments":"{\"cmd\":\"ls\"}"}},{"id":"c","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"x\"}"}}]}`),
		json.RawMessage(`{"role":"tool","tool_call_id":"b","content":"x.go"}`),
	}
	if m, err := l.Match(ms); err != nil || m.Position != 2 {
		t.Fatalf("tool calls: %+v %v", m, err)
	}
}

func TestMatchResponsesAPI(t *testing.T) {
	resp := json.RawMessage(`{"id":"resp_1","object":"response","output":[
	  {"type":"reasoning","summary":[]},
	  {"type":"message","role":"assistant","content":[{"type":"output_text","text":"checking"}]},
	  {"type":"function_call","call_id":"fc1","name":"bash","arguments":"{\"cmd\":\"ls\"}"}]}`)
	l, _ := ledgerWith(t, resp)
	sent := json.RawMessage(`{"role":"assistant","content":"checking","tool_calls":[{"id":"fc1","type":"function","function":{"name":"bash","arguments":"{\"cmd\":\"ls\"}"}}]}`)
	if m, err := l.Match(conv(sent)); err != nil || m.Position != 1 {
		t.Fatalf("responses API: %+v %v", m, err)
	}
}

// editLine replaces the first occurrence of old in line n (1-based) of the
// ledger file.
func editLine(t *testing.T, path string, n int, old, new string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := bytes.SplitAfter(data, []byte("\n"))
	if !bytes.Contains(lines[n-1], []byte(old)) {
		t.Fatalf("line %d has no %q: %s", n, old, lines[n-1])
	}
	lines[n-1] = bytes.Replace(lines[n-1], []byte(old), []byte(new), 1)
	if err := os.WriteFile(path, bytes.Join(lines, nil), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestEditedEntryIsFound(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	for i := 1; i <= 3; i++ {
		mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprintf("answer %d", i))))
	}
	l.Close()
	path := filepath.Join(dir, "ep.ledger")
	editLine(t, path, 3, "answer 2", "answer 7") // one byte of entry 2's response
	rep, err := Verify(dir, "ep")
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK || rep.Bad == nil || rep.Bad.Line != 3 || rep.Bad.Seq != 2 || rep.Bad.What != errHash.Error() || rep.Records != 2 {
		t.Fatalf("verify: %+v %+v", rep, rep.Bad)
	}
	_, err = Open(dir, "ep")
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "line 3 (seq 2)") || !strings.Contains(err.Error(), "stasis ledger verify ep") {
		t.Fatalf("open: %v", err)
	}
	if _, err := Read(dir, "ep"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("read: %v", err)
	}
}

func TestRemovedOrRenamedRecordIsFound(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	for i := 1; i <= 3; i++ {
		mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprint(i))))
	}
	l.Close()
	path := filepath.Join(dir, "ep.ledger")
	data, _ := os.ReadFile(path)
	lines := bytes.SplitAfter(data, []byte("\n"))
	// Drop entry 2: entry 3's parent no longer links.
	if err := os.WriteFile(path, bytes.Join(append(lines[:2:2], lines[3:]...), nil), 0o600); err != nil {
		t.Fatal(err)
	}
	rep, _ := Verify(dir, "ep")
	if rep.OK || rep.Bad.Line != 3 || rep.Bad.Seq != 3 || !strings.Contains(rep.Bad.What, "removed, inserted or reordered") {
		t.Fatalf("removed line: %+v", rep.Bad)
	}
	// The whole file under another episode's name.
	if err := os.WriteFile(filepath.Join(dir, "other.ledger"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	rep, _ = Verify(dir, "other")
	if rep.OK || rep.Bad.Line != 1 || !strings.Contains(rep.Bad.What, `episode "ep", not "other"`) {
		t.Fatalf("renamed: %+v", rep.Bad)
	}
	// A line that is not a record.
	if err := os.WriteFile(path, append(append([]byte{}, data...), "garbage\n"...), 0o600); err != nil {
		t.Fatal(err)
	}
	if rep, _ = Verify(dir, "ep"); rep.OK || rep.Bad.Line != 5 || !strings.Contains(rep.Bad.What, "not a ledger record") {
		t.Fatalf("garbage: %+v", rep.Bad)
	}
	if _, err := Verify(dir, "missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing: %v", err)
	}
}

func TestTornLastLineIsIgnoredAndRepaired(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	mustAppend(t, l, entry("ep/1", chat("one")))
	mustAppend(t, l, entry("ep/2", chat("two")))
	l.Close()
	path := filepath.Join(dir, "ep.ledger")
	data, _ := os.ReadFile(path)
	// A crash in the middle of appending entry 3: half a line, no newline.
	l3, _, err := encodeRecord(entryRecord(entry("ep/3", chat("three"))))
	if err != nil {
		t.Fatal(err)
	}
	torn := append(append([]byte{}, data...), l3[:len(l3)/2]...)
	if err := os.WriteFile(path, torn, 0o600); err != nil {
		t.Fatal(err)
	}
	rep, err := Verify(dir, "ep")
	if err != nil || !rep.OK || rep.Live != 2 || rep.TornBytes != int64(len(l3)/2) {
		t.Fatalf("verify torn: %+v %v", rep, err)
	}
	l = open(t, dir, "ep")
	if l.Len() != 2 {
		t.Fatalf("len %d", l.Len())
	}
	if _, ok := l.Lookup("ep/3"); ok {
		t.Fatal("the torn entry is visible")
	}
	e := mustAppend(t, l, entry("ep/3", chat("three")))
	if e.Seq != 3 {
		t.Fatalf("append after torn: %+v", e)
	}
	l.Close()
	after, _ := os.ReadFile(path)
	if !bytes.HasPrefix(after, data) || bytes.Count(after, []byte("\n")) != 4 || !bytes.HasSuffix(after, []byte("\n")) {
		t.Fatalf("file after repair:\n%s", after)
	}
	if rep, err := Verify(dir, "ep"); err != nil || !rep.OK || rep.TornBytes != 0 || rep.Live != 3 {
		t.Fatalf("verify after repair: %+v %v", rep, err)
	}
}

func TestEpisodeNames(t *testing.T) {
	dir := t.TempDir()
	for _, bad := range []string{"", "../x", "..", ".", "a/b", "/abs", ".hidden", "a b", "a\x00b", strings.Repeat("x", 201)} {
		if _, err := Open(dir, bad); err == nil || !strings.Contains(err.Error(), "episode name") {
			t.Errorf("Open(%q): %v", bad, err)
		}
		if _, err := Verify(dir, bad); err == nil {
			t.Errorf("Verify(%q) accepted it", bad)
		}
	}
	if entries, _ := os.ReadDir(filepath.Dir(dir)); len(entries) != 1 {
		t.Fatalf("files appeared beside the ledger directory: %v", entries)
	}
	for _, good := range []string{"ep1", "swe-bench.django__django-11099_0", "A.b-c_d"} {
		l, err := Open(dir, good)
		if err != nil {
			t.Fatalf("Open(%q): %v", good, err)
		}
		l.Close()
	}
}

func TestExtractTokens(t *testing.T) {
	vllm := json.RawMessage(`{"id":"x","object":"chat.completion","prompt_token_ids":[1,2,3],
	  "choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"token_ids":[7,8],
	    "logprobs":{"content":[{"token":"h","logprob":-0.5,"top_logprobs":[]},{"token":"i","logprob":-0.25}]}}]}`)
	got := ExtractTokens(vllm)
	if got == nil || fmt.Sprint(got.PromptIDs, got.CompletionIDs, got.Logprobs) != "[1 2 3] [7 8] [-0.5 -0.25]" {
		t.Fatalf("vLLM: %+v", got)
	}
	for _, plain := range []string{
		`{"choices":[{"message":{"role":"assistant","content":"hi"}}]}`,
		`{"choices":[{"message":{"content":"x"},"logprobs":null,"token_ids":null}],"prompt_token_ids":null}`,
		`{"choices":[]}`, `{}`, `[]`, `null`, `not json`,
		`{"prompt_token_ids":[1,"x"],"choices":[{"token_ids":"no"}]}`,
	} {
		if got := ExtractTokens(json.RawMessage(plain)); got != nil {
			t.Errorf("ExtractTokens(%s) = %+v, want nil", plain, got)
		}
	}
	// Only completion ids (SGLang without prompt ids).
	if got := ExtractTokens(json.RawMessage(`{"choices":[{"token_ids":[5]}]}`)); got == nil || len(got.CompletionIDs) != 1 || got.PromptIDs != nil {
		t.Fatalf("completion ids only: %+v", got)
	}
	// Append fills Tokens from the response.
	l := open(t, t.TempDir(), "ep")
	if e := mustAppend(t, l, entry("ep/1", vllm)); e.Tokens == nil || len(e.Tokens.CompletionIDs) != 2 {
		t.Fatalf("append: %+v", e.Tokens)
	}
}

func FuzzDecodeRecord(f *testing.F) {
	recs := []record{
		{Kind: kindHeader, Format: formatVersion, Episode: "ep", At: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)},
		entryRecord(entry("ep/1", chat("hello <world> & \"you\"", "bash", `{"cmd":"ls"}`))),
		{Kind: kindCut, To: new(int64(2)), Reason: "restore", Boundary: true, Parent: strings.Repeat("a", 64)},
		{Kind: kindBroken, Reason: "relaunch: no match", Parent: strings.Repeat("0", 64)},
		{Kind: kindHeader, Format: formatV1, Episode: "ep", At: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)},
		{Kind: kindSettle, Settled: []Settlement{{Seq: 1, CallID: "ep/1", Disposition: Delivered}, {Seq: 2, CallID: "ep/<2>", Disposition: Abandoned}},
			At: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC), Parent: strings.Repeat("b", 64)},
		{Kind: kindSettle, Settled: []Settlement{{Seq: 1, CallID: "ep/1", Disposition: Pending}}, Parent: strings.Repeat("b", 64)},
		{Kind: kindSettle, Settled: []Settlement{}, Parent: strings.Repeat("b", 64)},
		{Kind: kindBranch, From: strings.Repeat("c", 64), Reason: "restore ckpt-1", At: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC), Parent: strings.Repeat("d", 64)},
		{Kind: kindBranch, From: "not a hash", Parent: strings.Repeat("d", 64)},
	}
	e := entryRecord(entry("ep/2", chat("x")))
	e.Seq, e.Tokens, e.Usage = 2, &Tokens{PromptIDs: []int64{1, 2}, CompletionIDs: []int64{3}, Logprobs: []float64{-0.125}}, json.RawMessage(`{"prompt_tokens":2}`)
	recs = append(recs, e)
	for _, r := range recs {
		if r.Kind == kindEntry && r.Seq == 0 {
			r.Seq = 1
		}
		line, _, err := encodeRecord(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(line)
	}
	f.Add([]byte(`{"kind":"entry","hash":"` + strings.Repeat("0", 64) + `"}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		checkStable(t, line)
		// Most mutations break the hash; give them a right one too, so the
		// fuzzer reaches the JSON and field checks behind it.
		if n := len(line); n > hashLen+2 {
			sum := sha256.Sum256(append(append([]byte{}, line[:n-2-hashLen]...), line[n-2:]...))
			fixed := append(append(append([]byte{}, line[:n-2-hashLen]...), hex.EncodeToString(sum[:])...), line[n-2:]...)
			checkStable(t, fixed)
		}
	})
}

// checkStable decodes line and, when it is accepted, checks that it
// re-encodes stably.
func checkStable(t *testing.T, line []byte) {
	t.Helper()
	r, err := decodeRecord(line)
	if err != nil {
		return
	}
	// An accepted record re-encodes to a line that decodes to the
	// same record and encodes to the same bytes again.
	l2, h2, err := encodeRecord(r)
	if err != nil {
		t.Fatalf("accepted record does not encode: %v\n%q", err, line)
	}
	r2, err := decodeRecord(l2)
	if err != nil {
		t.Fatalf("re-encoded record does not decode: %v\n%q\n%q", err, line, l2)
	}
	if r2.Hash != h2 {
		t.Fatalf("hash %s, encoder said %s", r2.Hash, h2)
	}
	l3, _, err := encodeRecord(r2)
	if err != nil || !bytes.Equal(l2, l3) {
		t.Fatalf("unstable encoding: %v\n%q\n%q", err, l2, l3)
	}
}

func BenchmarkAppend(b *testing.B) {
	resp := chat(strings.Repeat("some model output ", 100), "bash", `{"cmd":"go test ./..."}`)
	b.Run("ledger", func(b *testing.B) {
		l := open(b, b.TempDir(), "ep")
		for i := 0; b.Loop(); i++ {
			if _, err := l.Append(entry(fmt.Sprintf("ep/%d", i), resp)); err != nil {
				b.Fatal(err)
			}
		}
	})
	// Baseline: the same bytes written with one write and one fsync each.
	b.Run("write+fsync", func(b *testing.B) {
		line, _, err := encodeRecord(entryRecord(entry("ep/1", resp)))
		if err != nil {
			b.Fatal(err)
		}
		line = append(line, '\n')
		f, err := os.OpenFile(filepath.Join(b.TempDir(), "raw"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		b.SetBytes(int64(len(line)))
		for b.Loop() {
			if _, err := f.Write(line); err != nil {
				b.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A harness that saved its turn before the model's answer was in it (as
// OpenCode does, when a stop pause comes right after a delivery) re-sends
// that turn empty, or with a tool call but not its arguments: the response
// was not acted on whole, and the ledger is cut before it rather than
// marked broken. A ledger entry whose response really was empty still
// matches an empty message exactly; a mismatch before the last turn is
// still a broken history.
func TestMatchLostResponseSentBackEmpty(t *testing.T) {
	r := []json.RawMessage{chat("a"), chat("b")}
	l, _ := ledgerWith(t, r...)
	empty := json.RawMessage(`{"role":"assistant","content":""}`)
	m, err := l.Match(conv(asMessage(t, r[0]), empty))
	if err != nil || m.Position != 1 || !m.Boundary {
		t.Fatalf("match: %+v %v", m, err)
	}
	if b, _ := l.Broken(); b || l.Len() != 1 {
		t.Fatalf("broken %v, len %d", b, l.Len())
	}
	// Only the empty turn: a start over.
	l2, _ := ledgerWith(t, r[0])
	if m, err := l2.Match(conv(json.RawMessage(`{"role":"assistant","content":null}`))); err != nil || m.Position != 0 || !m.Boundary {
		t.Fatalf("start over: %+v %v", m, err)
	}
	// An empty response in the ledger matches an empty message as it is.
	l3, _ := ledgerWith(t, chat("a"), chat(""))
	if m, err := l3.Match(conv(asMessage(t, chat("a")), empty)); err != nil || m.Position != 2 {
		t.Fatalf("empty response: %+v %v", m, err)
	}
	// The last turn a partial copy of its entry's response (a tool call
	// saved without its arguments): cut before it.
	withCall := json.RawMessage(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Let me look.","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls\"}"}}]},"finish_reason":"tool_calls"}]}`)
	l4, _ := ledgerWith(t, r[0], withCall)
	partial := json.RawMessage(`{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{}"}}]}`)
	if m, err := l4.Match(conv(asMessage(t, r[0]), partial)); err != nil || m.Position != 1 || !m.Boundary {
		t.Fatalf("partial last turn: %+v %v", m, err)
	}
	// A tool call the response does not have is no partial copy.
	l6, _ := ledgerWith(t, r[0], withCall)
	other := json.RawMessage(`{"role":"assistant","content":"","tool_calls":[{"id":"c2","type":"function","function":{"name":"bash","arguments":"{}"}}]}`)
	if _, err := l6.Match(conv(asMessage(t, r[0]), other)); !errors.Is(err, ErrBroken) {
		t.Fatalf("a foreign tool call: %v", err)
	}
	// A turn before the last that is not in the ledger is still broken.
	l5, _ := ledgerWith(t, chat("a"), chat("b"), chat("c"))
	if _, err := l5.Match(conv(asMessage(t, chat("other")), asMessage(t, chat("b")))); !errors.Is(err, ErrBroken) {
		t.Fatalf("mismatch before the last turn: %v", err)
	}
}
