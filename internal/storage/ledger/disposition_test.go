package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// dispositions lists the entries' seq, call id and disposition.
func dispositions(es []Entry) string {
	var s []string
	for _, e := range es {
		s = append(s, fmt.Sprintf("%d:%s:%s", e.Seq, e.CallID, e.Disposition))
	}
	return strings.Join(s, " ")
}

func fileBytes(t *testing.T, dir, ep string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, ep+".ledger"))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestSettle(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	for i := 1; i <= 4; i++ {
		if e := mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprint(i)))); e.Disposition != Pending {
			t.Fatalf("appended entry %d is %q, want pending", i, e.Disposition)
		}
	}
	if n := l.DeliveredBefore(5); n != 4 {
		t.Fatalf("DeliveredBefore(5) with all pending = %d, want 4", n)
	}
	// Two settlements, one record.
	before := fileBytes(t, dir, "ep")
	if err := l.Settle(Settlement{1, "ep/1", Delivered}, Settlement{2, "ep/2", Abandoned}); err != nil {
		t.Fatal(err)
	}
	after := fileBytes(t, dir, "ep")
	added := after[len(before):]
	if bytes.Count(added, []byte("\n")) != 1 || !bytes.HasPrefix(added, []byte(`{"kind":"settle","settled":[{"seq":1,"call_id":"ep/1","disposition":"delivered"},{"seq":2,"call_id":"ep/2","disposition":"abandoned"}],"at":"`)) {
		t.Fatalf("settle wrote:\n%s", added)
	}
	if got := dispositions(l.Entries()); got != "1:ep/1:delivered 2:ep/2:abandoned 3:ep/3:pending 4:ep/4:pending" {
		t.Fatalf("entries: %s", got)
	}
	if e, _ := l.Lookup("ep/2"); e.Disposition != Abandoned {
		t.Fatalf("lookup: %+v", e)
	}
	for seq, want := range map[int64]int64{-3: 0, 0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 3, 99: 3} {
		if n := l.DeliveredBefore(seq); n != want {
			t.Errorf("DeliveredBefore(%d) = %d, want %d", seq, n, want)
		}
	}
	// The same again: nothing written. Nothing at all: nothing written.
	if err := l.Settle(Settlement{2, "ep/2", Abandoned}, Settlement{1, "ep/1", Delivered}, Settlement{1, "ep/1", Delivered}); err != nil {
		t.Fatal(err)
	}
	if err := l.Settle(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(fileBytes(t, dir, "ep"), after) {
		t.Fatal("a repeated settlement wrote something")
	}
	// Bad settlements fail the whole call and write nothing, the good one
	// beside them included.
	good := Settlement{3, "ep/3", Delivered}
	for _, c := range []struct {
		bad  Settlement
		says string
	}{
		{Settlement{1, "ep/1", Abandoned}, "was settled delivered; it cannot become abandoned"},
		{Settlement{4, "ep/3", Delivered}, "seq 4 is call ep/4, not ep/3"},
		{Settlement{5, "ep/5", Delivered}, "not a live entry: the logical ledger has 4 entries"},
		{Settlement{0, "ep/0", Delivered}, "at least 1"},
		{Settlement{4, "", Delivered}, "empty call id"},
		{Settlement{4, "ep/4", Pending}, `disposition "pending"`},
		{Settlement{4, "ep/4", Undelivered}, `disposition "undelivered"`},
		{Settlement{4, "ep/4", "lost"}, `disposition "lost"`},
		{Settlement{3, "ep/3", Abandoned}, "seq 3 (call ep/3) is settled both delivered and abandoned"},
	} {
		err := l.Settle(good, c.bad)
		if err == nil || !strings.Contains(err.Error(), c.says) || !strings.Contains(err.Error(), "nothing was settled") {
			t.Errorf("Settle(%+v): %v, want an error saying %q", c.bad, err, c.says)
		}
	}
	if !bytes.Equal(fileBytes(t, dir, "ep"), after) {
		t.Fatal("a failed settle wrote something")
	}
	if e, _ := l.Lookup("ep/3"); e.Disposition != Pending {
		t.Fatalf("a failed settle changed entry 3: %+v", e)
	}
	// A cut: entries 3 (settled first) and 4 (pending) are dropped; a
	// settlement of a dropped entry is refused.
	if err := l.Settle(good); err != nil {
		t.Fatal(err)
	}
	if err := l.Cut(2, "restore"); err != nil {
		t.Fatal(err)
	}
	if err := l.Settle(Settlement{3, "ep/3", Delivered}); err == nil || !strings.Contains(err.Error(), "not a live entry") {
		t.Fatalf("settle of a cut entry: %v", err)
	}
	e := mustAppend(t, l, entry("ep/3", chat("3 again")))
	if e.Seq != 3 || e.Disposition != Pending {
		t.Fatalf("re-issued: %+v", e)
	}
	if err := l.Settle(Settlement{3, "ep/3", Delivered}); err != nil {
		t.Fatalf("settle of the re-issued call: %v", err)
	}
	// Everything survives a reopen, and Read and Verify see it.
	l.Close()
	l = open(t, dir, "ep")
	if got := dispositions(l.Entries()); got != "1:ep/1:delivered 2:ep/2:abandoned 3:ep/3:delivered" {
		t.Fatalf("after reopen: %s", got)
	}
	if err := l.Settle(Settlement{2, "ep/2", Delivered}); err == nil {
		t.Fatal("after reopen, a settled entry changed its disposition")
	}
	h, err := Read(dir, "ep")
	if err != nil {
		t.Fatal(err)
	}
	if got := dispositions(h.Entries); got != "1:ep/1:delivered 2:ep/2:abandoned 3:ep/3:delivered" || h.Format != 2 {
		t.Fatalf("read: %s, format %d", got, h.Format)
	}
	if got := dispositions(h.Dropped); got != "3:ep/3:delivered 4:ep/4:undelivered" {
		t.Fatalf("dropped: %s", got)
	}
	rep, err := Verify(dir, "ep")
	if err != nil || !rep.OK || rep.Format != 2 || rep.Entries != 5 || rep.Live != 3 ||
		rep.Delivered != 3 || rep.Abandoned != 1 || rep.Pending != 0 || rep.Undelivered != 1 {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

// TestSettleConcurrentWithAppends: settlements and appends from many
// goroutines end in a file that reads back with every disposition.
func TestSettleConcurrentWithAppends(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	const n = 40
	done := make(chan error, n)
	for i := 1; i <= n; i++ {
		go func() {
			e, err := l.Append(entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprint(i))))
			if err == nil {
				d := Delivered
				if i%3 == 0 {
					d = Abandoned
				}
				err = l.Settle(Settlement{e.Seq, e.CallID, d})
			}
			done <- err
		}()
	}
	for range n {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	rep, err := Verify(dir, "ep")
	if err != nil || !rep.OK || rep.Delivered != n-n/3 || rep.Abandoned != n/3 || rep.Pending != 0 || rep.Records != 1+2*n {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

// TestFormat1LedgerStillWorks opens a ledger written before dispositions
// were recorded (testdata/format1.ledger, format 1): it reads, verifies,
// takes appends and settlements, and keeps its header.
func TestFormat1LedgerStillWorks(t *testing.T) {
	orig, err := os.ReadFile("testdata/format1.ledger")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(orig, []byte(`{"kind":"ledger","format":1,"episode":"format1"`)) {
		t.Fatalf("testdata/format1.ledger is not a format-1 ledger:\n%.100s", orig)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "format1.ledger"), orig, 0o600); err != nil {
		t.Fatal(err)
	}
	rep, err := Verify(dir, "format1")
	if err != nil || !rep.OK || rep.Format != 1 || rep.Records != 8 || rep.Entries != 5 || rep.Live != 2 || rep.Cuts != 2 ||
		rep.Delivered != 2 || rep.Abandoned != 0 || rep.Pending != 0 || rep.Undelivered != 3 {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	h, err := Read(dir, "format1")
	if err != nil {
		t.Fatal(err)
	}
	if got := dispositions(h.Entries); got != "1:format1/1:delivered 2:format1/2:delivered" || !h.Entries[1].Boundary || h.Entries[1].Attempt != 3 {
		t.Fatalf("read entries: %s %+v", got, h.Entries)
	}
	if got := dispositions(h.Dropped); got != "3:format1/3:undelivered 2:format1/2:undelivered 3:format1/3:undelivered" {
		t.Fatalf("read dropped: %s", got)
	}
	l := open(t, dir, "format1")
	if n := l.DeliveredBefore(3); n != 2 {
		t.Fatalf("DeliveredBefore(3) = %d", n)
	}
	// An entry read as delivered may still be settled, once, either way.
	if err := l.Settle(Settlement{2, "format1/2", Abandoned}); err != nil {
		t.Fatal(err)
	}
	if err := l.Settle(Settlement{2, "format1/2", Delivered}); err == nil {
		t.Fatal("a settled format-1 entry changed its disposition")
	}
	e := mustAppend(t, l, entry("format1/3", chat("three, new code")))
	if e.Seq != 3 || e.Disposition != Delivered {
		t.Fatalf("append to a format-1 ledger: %+v", e)
	}
	if err := l.Settle(Settlement{3, "format1/3", Delivered}, Settlement{1, "format1/1", Delivered}); err != nil {
		t.Fatal(err)
	}
	if n := l.DeliveredBefore(4); n != 2 {
		t.Fatalf("DeliveredBefore(4) = %d", n)
	}
	l.Close()
	data := fileBytes(t, dir, "format1")
	if !bytes.HasPrefix(data, orig) {
		t.Fatal("the format-1 file was rewritten, not appended to")
	}
	rep, err = Verify(dir, "format1")
	if err != nil || !rep.OK || rep.Format != 1 || rep.Records != 11 || rep.Live != 3 || rep.Delivered != 2 || rep.Abandoned != 1 || rep.Undelivered != 3 {
		t.Fatalf("verify after appends: %+v %v", rep, err)
	}
	l = open(t, dir, "format1")
	if got := dispositions(l.Entries()); got != "1:format1/1:delivered 2:format1/2:abandoned 3:format1/3:delivered" {
		t.Fatalf("after reopen: %s", got)
	}
}

// writeRecords writes a ledger file of records, chaining parents and
// hashes as Append does (records a Ledger would refuse to write included).
func writeRecords(t *testing.T, dir, ep string, recs ...record) {
	t.Helper()
	var buf []byte
	parent := ""
	for _, r := range recs {
		r.Parent = parent
		line, h, err := encodeRecord(r)
		if err != nil {
			t.Fatal(err)
		}
		buf = append(append(buf, line...), '\n')
		parent = h
	}
	if err := os.WriteFile(filepath.Join(dir, ep+".ledger"), buf, 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestBadSettleRecordsAreFound(t *testing.T) {
	at := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	head := record{Kind: kindHeader, Format: formatVersion, Episode: "ep", At: at}
	e1, e2 := entryRecord(entry("ep/1", chat("1"))), entryRecord(entry("ep/2", chat("2")))
	e1.Seq, e2.Seq = 1, 2
	settle := func(ss ...Settlement) record { return record{Kind: kindSettle, Settled: ss, At: at} }
	cut := int64(1)
	for _, c := range []struct {
		name string
		recs []record
		line int
		says string
	}{
		{"changed disposition", []record{head, e1, settle(Settlement{1, "ep/1", Delivered}), settle(Settlement{1, "ep/1", Abandoned})}, 4, "was settled delivered; it cannot become abandoned"},
		{"changed within a record", []record{head, e1, settle(Settlement{1, "ep/1", Delivered}, Settlement{1, "ep/1", Abandoned})}, 3, "settled both"},
		{"wrong call id", []record{head, e1, e2, settle(Settlement{2, "ep/1", Delivered})}, 4, "seq 2 is call ep/2, not ep/1"},
		{"cut entry", []record{head, e1, e2, {Kind: kindCut, To: &cut, Reason: "r", At: at}, settle(Settlement{2, "ep/2", Delivered})}, 5, "not a live entry"},
		{"before any entry", []record{head, settle(Settlement{1, "ep/1", Delivered})}, 2, "not a live entry"},
		{"empty", []record{head, e1, settle()}, 3, "names no entry"},
		{"pending", []record{head, e1, settle(Settlement{1, "ep/1", Pending})}, 3, `disposition "pending"`},
		{"no seq", []record{head, e1, settle(Settlement{0, "ep/1", Delivered})}, 3, "at least 1"},
		{"format 3", []record{{Kind: kindHeader, Format: 3, Episode: "ep", At: at}, e1}, 1, "format 3; this stasis reads formats 1 to 2"},
		{"format 0", []record{{Kind: kindHeader, Episode: "ep", At: at}, e1}, 1, "format 0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			writeRecords(t, dir, "ep", c.recs...)
			before := fileBytes(t, dir, "ep")
			rep, err := Verify(dir, "ep")
			if err != nil || rep.OK || rep.Bad == nil || rep.Bad.Line != c.line || !strings.Contains(rep.Bad.What, c.says) {
				t.Fatalf("verify: %+v %+v %v, want line %d saying %q", rep, rep.Bad, err, c.line, c.says)
			}
			if _, err := Open(dir, "ep"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("open: %v", err)
			}
			if _, err := Read(dir, "ep"); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("read: %v", err)
			}
			if !bytes.Equal(fileBytes(t, dir, "ep"), before) {
				t.Fatal("the damaged file was changed")
			}
		})
	}
	// A repeated disposition is harmless.
	dir := t.TempDir()
	writeRecords(t, dir, "ep", head, e1, settle(Settlement{1, "ep/1", Abandoned}), settle(Settlement{1, "ep/1", Abandoned}, Settlement{1, "ep/1", Abandoned}))
	if rep, err := Verify(dir, "ep"); err != nil || !rep.OK || rep.Abandoned != 1 {
		t.Fatalf("repeated disposition: %+v %+v %v", rep, rep.Bad, err)
	}
}

// TestSettleAndAppend: settlements ride on the next entry in one write
// (one flush); settlements that do not hold are left out whole and the
// entry is appended all the same.
func TestSettleAndAppend(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "ep")
	mustAppend(t, l, entry("ep/1", chat("1")))
	mustAppend(t, l, entry("ep/2", chat("2")))
	before := fileBytes(t, dir, "ep")
	e, serr, err := l.SettleAndAppend([]Settlement{{1, "ep/1", Delivered}, {2, "ep/2", Abandoned}}, entry("ep/3", chat("3")))
	if err != nil || serr != nil || e.Seq != 3 || e.Disposition != Pending {
		t.Fatalf("settle and append: %+v %v %v", e, serr, err)
	}
	added := fileBytes(t, dir, "ep")[len(before):]
	if lines := bytes.Split(bytes.TrimSuffix(added, []byte("\n")), []byte("\n")); len(lines) != 2 ||
		!bytes.HasPrefix(lines[0], []byte(`{"kind":"settle"`)) || !bytes.HasPrefix(lines[1], []byte(`{"kind":"entry","seq":3`)) {
		t.Fatalf("one write of a settle record and the entry, got:\n%s", added)
	}
	// A contradiction (ep/2 was abandoned) and a repeat: the settlements
	// are left out whole, the entry goes in.
	e, serr, err = l.SettleAndAppend([]Settlement{{3, "ep/3", Delivered}, {2, "ep/2", Delivered}}, entry("ep/4", chat("4")))
	if err != nil || serr == nil || e.Seq != 4 {
		t.Fatalf("a contradicting settlement: %+v %v %v", e, serr, err)
	}
	if got := dispositions(l.Entries()); got != "1:ep/1:delivered 2:ep/2:abandoned 3:ep/3:pending 4:ep/4:pending" {
		t.Fatalf("entries: %s", got)
	}
	// A duplicate call id is refused and writes nothing, settlements
	// included.
	before = fileBytes(t, dir, "ep")
	if _, _, err := l.SettleAndAppend([]Settlement{{3, "ep/3", Delivered}}, entry("ep/4", chat("4"))); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("duplicate: %v", err)
	}
	if !bytes.Equal(before, fileBytes(t, dir, "ep")) {
		t.Fatal("a refused append changed the file")
	}
	if rep, err := Verify(dir, "ep"); err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}
