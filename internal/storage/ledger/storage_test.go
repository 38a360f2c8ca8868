package ledger

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/pgtest"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

// storages are the Storage kinds every ledger behaviour below holds on.
var storages = []struct {
	name string
	make func(t *testing.T) Storage
}{
	{"files", func(t *testing.T) Storage { return Files(t.TempDir()) }},
	{"postgres", func(t *testing.T) Storage { return openPostgres(t, pgtest.DSN(t)) }},
}

func openPostgres(t *testing.T, dsn string) *Postgres {
	t.Helper()
	p, err := OpenPostgres(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func forEachStorage(t *testing.T, f func(t *testing.T, s Storage)) {
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) { f(t, st.make(t)) })
	}
}

func openIn(t *testing.T, s Storage, ep string) *Ledger {
	t.Helper()
	l, err := OpenIn(s, ep)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// checkCounts checks that Verify's dispositions add up to its entries.
func checkCounts(t *testing.T, s Storage, ep string) Report {
	t.Helper()
	rep, err := VerifyIn(s, ep)
	if err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
	if sum := rep.Delivered + rep.Abandoned + rep.Pending + rep.Undelivered; sum != rep.Entries {
		t.Fatalf("dispositions add up to %d, entries are %d: %+v", sum, rep.Entries, rep)
	}
	return rep
}

func TestStorageRoundTrip(t *testing.T) {
	forEachStorage(t, func(t *testing.T, s Storage) {
		if _, err := s.ReadAll("ep"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("ReadAll of none: %v", err)
		}
		l := openIn(t, s, "ep")
		for i := 1; i <= 4; i++ {
			mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i), chat(fmt.Sprint(i))))
		}
		if err := l.Settle(Settlement{Seq: 1, CallID: "ep/1", Disposition: Delivered}); err != nil {
			t.Fatal(err)
		}
		if err := l.Cut(3, "restore"); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, l, entry("ep/5", chat("5")))
		tip := l.Tip()
		l.Close()
		l2 := openIn(t, s, "ep")
		if got := seqs(l2.Entries()); got != "1:ep/1 2:ep/2 3:ep/3 4:ep/5" {
			t.Fatalf("after reopening: %s", got)
		}
		if l2.Tip() != tip {
			t.Fatalf("tip %+v, want %+v", l2.Tip(), tip)
		}
		rep := checkCounts(t, s, "ep")
		if rep.Entries != 5 || rep.Live != 4 || rep.Cuts != 1 || rep.Delivered != 1 || rep.Undelivered != 1 || rep.Head != tip.Hash {
			t.Fatalf("report: %+v", rep)
		}
		h, err := ReadIn(s, "ep")
		if err != nil || len(h.Entries) != 4 || len(h.Dropped) != 1 || h.Dropped[0].CallID != "ep/4" {
			t.Fatalf("read: %+v %v", h, err)
		}
		l2.Close()
		if err := s.Remove("ep"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.ReadAll("ep"); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("ReadAll after Remove: %v", err)
		}
		if err := s.Remove("ep"); err != nil {
			t.Fatalf("a second Remove: %v", err)
		}
	})
}

// A restore of an older checkpoint after the ledger moved on branches it
// back to that checkpoint's tip; the history it leaves stays readable,
// and a later branch can go back to it.
func TestBranch(t *testing.T) {
	forEachStorage(t, func(t *testing.T, s Storage) {
		l := openIn(t, s, "ep")
		mustAppend(t, l, entry("ep/1", chat("1")))
		mustAppend(t, l, entry("ep/2", chat("2")))
		if err := l.Settle(Settlement{Seq: 1, CallID: "ep/1", Disposition: Delivered}); err != nil {
			t.Fatal(err)
		}
		a := l.Tip() // checkpoint A: two entries, the first delivered
		mustAppend(t, l, entry("ep/3", chat("3")))
		if err := l.Settle(Settlement{Seq: 2, CallID: "ep/2", Disposition: Delivered}); err != nil {
			t.Fatal(err)
		}
		b := l.Tip() // checkpoint B: three entries
		// A restore of A in the old way: cut to A's position, new calls.
		if err := l.Cut(1, "restore A"); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, l, entry("ep/2b", chat("2b")))
		c := l.Tip()
		// B is no longer in the logical ledger; a branch brings it back.
		if err := l.Branch(b.Hash, "restore B"); err != nil {
			t.Fatal(err)
		}
		if got := seqs(l.Entries()); got != "1:ep/1 2:ep/2 3:ep/3" {
			t.Fatalf("after branching to B: %s", got)
		}
		if e, _ := l.At(2); e.Disposition != Delivered {
			t.Fatalf("ep/2 after the branch: %s, want delivered (settled before B)", e.Disposition)
		}
		if _, ok := l.Lookup("ep/2b"); ok {
			t.Fatal("ep/2b, of the history left, is still live")
		}
		mustAppend(t, l, entry("ep/4", chat("4")))
		checkCounts(t, s, "ep")
		// Back to A: ep/2 is pending again, as it was at A.
		if err := l.Branch(a.Hash, "restore A again"); err != nil {
			t.Fatal(err)
		}
		if got := seqs(l.Entries()); got != "1:ep/1 2:ep/2" {
			t.Fatalf("after branching to A: %s", got)
		}
		if e, _ := l.At(2); e.Disposition != Pending {
			t.Fatalf("ep/2 at A: %s, want pending", e.Disposition)
		}
		// And to C, the history the first branch left.
		if err := l.Branch(c.Hash, "restore C"); err != nil {
			t.Fatal(err)
		}
		if got := seqs(l.Entries()); got != "1:ep/1 2:ep/2b" {
			t.Fatalf("after branching to C: %s", got)
		}
		past, err := l.EntriesAt(b.Hash)
		if err != nil || seqs(past) != "1:ep/1 2:ep/2 3:ep/3" {
			t.Fatalf("EntriesAt(B): %s %v", seqs(past), err)
		}
		want := seqs(l.Entries())
		tip := l.Tip()
		checkHistoryAt(t, l, s)
		l.Close()
		l2 := openIn(t, s, "ep")
		if got := seqs(l2.Entries()); got != want || l2.Tip() != tip {
			t.Fatalf("after reopening: %s (tip %+v), want %s (tip %+v)", got, l2.Tip(), want, tip)
		}
		checkHistoryAt(t, l2, s)
		rep := checkCounts(t, s, "ep")
		if rep.Entries != 5 || rep.Live != 2 {
			t.Fatalf("report: %+v", rep)
		}
		h, err := ReadIn(s, "ep")
		if err != nil {
			t.Fatal(err)
		}
		var branches []string
		for _, ev := range h.Events {
			if ev.Kind == kindBranch {
				branches = append(branches, fmt.Sprintf("%s:%d->%d", ev.Reason, ev.From, ev.To))
			}
		}
		if got := strings.Join(branches, " "); got != "restore B:2->3 restore A again:4->2 restore C:2->2" {
			t.Fatalf("branch events: %s", got)
		}
		var dropped []string
		for _, e := range h.Dropped {
			dropped = append(dropped, e.CallID)
		}
		if got := strings.Join(dropped, " "); got != "ep/3 ep/4 ep/2" {
			t.Fatalf("dropped: %s", got)
		}
		// A branch to a hash the ledger does not hold changes nothing.
		if err := l2.Branch(strings.Repeat("ab", 32), "nowhere"); err == nil || !strings.Contains(err.Error(), "no record with that hash") {
			t.Fatalf("branch to an unknown hash: %v", err)
		}
		if l2.Tip() != tip {
			t.Fatal("a refused branch wrote something")
		}
	})
}

// checkHistoryAt holds HistoryAt, which answers from what the ledger
// kept as it wrote or read each record, to EntriesAt, which reads the
// bytes again, at every record of the ledger.
func checkHistoryAt(t *testing.T, l *Ledger, s Storage) {
	t.Helper()
	data, err := s.ReadAll(l.Episode())
	if err != nil {
		t.Fatal(err)
	}
	var hashes []string
	for line := range bytes.SplitSeq(bytes.TrimSuffix(data, []byte("\n")), []byte("\n")) {
		r, err := decodeRecord(line)
		if err != nil {
			t.Fatal(err)
		}
		hashes = append(hashes, r.Hash)
	}
	if tip := l.Tip(); len(hashes) != tip.Records || hashes[len(hashes)-1] != tip.Hash {
		t.Fatalf("%d records read, the last %.12s…; the ledger's tip is %+v", len(hashes), hashes[len(hashes)-1], tip)
	}
	for i, at := range hashes {
		past, err := l.EntriesAt(at)
		if err != nil {
			t.Fatal(err)
		}
		n, last, err := l.HistoryAt(at)
		if err != nil {
			t.Fatal(err)
		}
		want := ""
		if len(past) > 0 {
			want = past[len(past)-1].Hash
		}
		if n != int64(len(past)) || last != want {
			t.Fatalf("record %d: HistoryAt says %d entries, the last %.12s…; EntriesAt %d, the last %.12s…", i+1, n, last, len(past), want)
		}
	}
	if _, _, err := l.HistoryAt(strings.Repeat("ab", 32)); err == nil || !strings.Contains(err.Error(), "no record with hash") {
		t.Fatalf("HistoryAt of a hash the ledger does not hold: %v", err)
	}
}

// An episode started again as its next attempt takes its ledger back to
// its start: empty and no longer broken, the earlier history dropped but
// readable, and a branch (a restore of a checkpoint of that history)
// brings it back. A ledger at its start is left as it is.
func TestRestart(t *testing.T) {
	forEachStorage(t, func(t *testing.T, s Storage) {
		l := openIn(t, s, "ep")
		if err := l.Restart("nothing to do"); err != nil {
			t.Fatal(err)
		}
		if tip := l.Tip(); tip.Records != 0 {
			t.Fatalf("a restart of an empty ledger wrote %d records", tip.Records)
		}
		mustAppend(t, l, entry("ep/1", chat("1")))
		mustAppend(t, l, entry("ep/2", chat("2")))
		old := l.Tip()
		if err := l.markBroken("a relaunch that did not match"); err != nil {
			t.Fatal(err)
		}
		if err := l.Restart("restart as attempt 1"); err != nil {
			t.Fatal(err)
		}
		if n := l.Len(); n != 0 {
			t.Fatalf("after the restart: %d live entries", n)
		}
		if broken, why := l.Broken(); broken {
			t.Fatalf("after the restart the ledger is still broken: %s", why)
		}
		mustAppend(t, l, entry("ep/1000001", chat("1")))
		if got := seqs(l.Entries()); got != "1:ep/1000001" {
			t.Fatalf("the new attempt's history: %s", got)
		}
		tip := l.Tip()
		if err := l.Restart(""); err != nil {
			t.Fatal(err)
		}
		if l.Len() != 0 {
			t.Fatal("a second restart left entries")
		}
		l.Close()
		l = openIn(t, s, "ep")
		if l.Len() != 0 {
			t.Fatalf("after reopening: %s", seqs(l.Entries()))
		}
		rep := checkCounts(t, s, "ep")
		if rep.Entries != 3 || rep.Live != 0 || rep.Broken {
			t.Fatalf("report: %+v", rep)
		}
		h, err := ReadIn(s, "ep")
		if err != nil || len(h.Dropped) != 3 {
			t.Fatalf("read: %d dropped, %v", len(h.Dropped), err)
		}
		// A checkpoint of either history brings it back.
		if err := l.Branch(old.Hash, "restore the first attempt"); err != nil {
			t.Fatal(err)
		}
		if got := seqs(l.Entries()); got != "1:ep/1 2:ep/2" {
			t.Fatalf("after branching back to the first attempt: %s", got)
		}
		if err := l.Branch(tip.Hash, "restore the second attempt"); err != nil {
			t.Fatal(err)
		}
		if got := seqs(l.Entries()); got != "1:ep/1000001" {
			t.Fatalf("after branching back to the second attempt: %s", got)
		}
		checkCounts(t, s, "ep")
	})
}

// A ledger another writer appended to since it was opened (a database's,
// which the gateways of several nodes share) reads it again on Refresh and
// can then write after it; one in step with its storage is left as it is.
func TestRefresh(t *testing.T) {
	s := openPostgres(t, pgtest.DSN(t))
	a := openIn(t, s, "ep")
	mustAppend(t, a, entry("ep/1", chat("1")))
	if err := a.Refresh(); err != nil || a.Len() != 1 {
		t.Fatalf("a refresh in step: %d entries, %v", a.Len(), err)
	}
	b := openIn(t, s, "ep")
	mustAppend(t, b, entry("ep/2", chat("2")))
	mustAppend(t, b, entry("ep/3", chat("3")))
	if err := a.Refresh(); err != nil {
		t.Fatal(err)
	}
	if got := seqs(a.Entries()); got != "1:ep/1 2:ep/2 3:ep/3" || a.Tip() != b.Tip() {
		t.Fatalf("after the refresh: %s", got)
	}
	mustAppend(t, a, entry("ep/4", chat("4")))
	checkCounts(t, s, "ep")
}

// A newer attempt's fence keeps an older attempt's writer out.
func TestFence(t *testing.T) {
	forEachStorage(t, func(t *testing.T, s Storage) {
		l := openIn(t, s, "ep")
		if err := l.Fence(2); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, l, entry("ep/1", chat("1")))
		if err := l.Fence(1); !errors.Is(err, ErrFenced) {
			t.Fatalf("fence back to 1: %v", err)
		}
		if _, err := l.Append(entry("ep/2", chat("2"))); !errors.Is(err, ErrFenced) {
			t.Fatalf("append after a refused fence: %v", err)
		}
	})
}

// Two gateways holding one episode's ledger in PostgreSQL (a node that
// lost the episode, and the node that took it): the newer attempt's fence
// keeps the older out, and whoever appends on a stale view is refused and
// changes nothing.
func TestPostgresTwoWriters(t *testing.T) {
	p := openPostgres(t, pgtest.DSN(t))
	old := openIn(t, p, "ep")
	if err := old.Fence(1); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, old, entry("ep/1", chat("1")))
	taker := openIn(t, p, "ep")
	if err := taker.Fence(2); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Append(entry("ep/2", chat("2"))); !errors.Is(err, ErrFenced) || !strings.Contains(err.Error(), "attempt 2 has taken the episode") {
		t.Fatalf("the old attempt's append: %v", err)
	}
	if err := taker.Cut(1, "restore"); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, taker, entry("ep/2", chat("2 again")))
	// A second writer of the same attempt that read before the first
	// appended is refused too.
	stale := openIn(t, p, "ep")
	if err := stale.Fence(2); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, taker, entry("ep/3", chat("3")))
	if _, err := stale.Append(entry("ep/x", chat("x"))); !errors.Is(err, ErrFenced) || !strings.Contains(err.Error(), "another gateway has written") {
		t.Fatalf("a stale writer's append: %v", err)
	}
	if got := seqs(openIn(t, p, "ep").Entries()); got != "1:ep/1 2:ep/2 3:ep/3" {
		t.Fatalf("entries: %s", got)
	}
	checkCounts(t, p, "ep")
}

// Many episodes appending at once share commits.
func TestPostgresGroupCommit(t *testing.T) {
	p := openPostgres(t, pgtest.DSN(t))
	const episodes, each = 64, 5
	ls := make([]*Ledger, episodes)
	for i := range ls {
		ls[i] = openIn(t, p, fmt.Sprint("ep", i))
	}
	c0, a0 := p.Commits()
	var wg sync.WaitGroup
	errs := make(chan error, episodes)
	for i, l := range ls {
		wg.Go(func() {
			for n := 1; n <= each; n++ {
				id := fmt.Sprintf("ep%d/%d", i, n)
				if _, err := l.Append(entry(id, chat(id))); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	c1, a1 := p.Commits()
	if a1-a0 < episodes*each || c1-c0 >= a1-a0 {
		t.Fatalf("%d appends took %d commits: none were shared", a1-a0, c1-c0)
	}
	t.Logf("%d appends in %d commits", a1-a0, c1-c0)
	for i := range ls {
		rep := checkCounts(t, p, fmt.Sprint("ep", i))
		if rep.Live != each {
			t.Fatalf("ep%d: %+v", i, rep)
		}
	}
}

// A node whose lease ran out (cut off from the database past it) appends
// nothing more, nor fences; the node that joins after it does.
func TestPostgresPartitionedNodeCannotAppend(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	st, err := store.OpenPostgres(ctx, dsn) // the nodes table is the store's
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	p := openPostgres(t, dsn)
	n, err := st.Join(ctx, "node-p", "", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	l := openIn(t, p.AsNode(n.Name, n.Epoch), "ep")
	if err := l.Fence(1); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, l, entry("ep/1", chat("1")))
	testwait.Until(t, "the node's lease to run out", 30*time.Second, func() bool {
		ns, _ := st.Nodes(ctx)
		return len(ns) == 1 && !ns[0].Live
	})
	if _, err := l.Append(entry("ep/2", chat("2"))); !errors.Is(err, ErrFenced) || !strings.Contains(err.Error(), "no longer holds a live lease") {
		t.Fatalf("append by a node whose lease ran out: %v", err)
	}
	other := openIn(t, p.AsNode(n.Name, n.Epoch), "ep")
	if err := other.Fence(2); !errors.Is(err, ErrFenced) {
		t.Fatalf("fence by a node whose lease ran out: %v", err)
	}
	n2, err := st.Join(ctx, "node-q", "", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	taker := openIn(t, p.AsNode(n2.Name, n2.Epoch), "ep")
	if err := taker.Fence(2); err != nil {
		t.Fatal(err)
	}
	mustAppend(t, taker, entry("ep/2", chat("2")))
	if got := seqs(openIn(t, p, "ep").Entries()); got != "1:ep/1 2:ep/2" {
		t.Fatalf("entries: %s", got)
	}
}

// counting is a Storage that counts its ReadAll calls; with shared set,
// its logs do not say they are their ledger's only writer, as a log in a
// storage several writers share does not.
type counting struct {
	Files
	shared bool
	reads  int
}

func (c *counting) ReadAll(ep string) ([]byte, error) {
	c.reads++
	return c.Files.ReadAll(ep)
}

func (c *counting) OpenLog(ep string) (Log, []byte, error) {
	log, data, err := c.Files.OpenLog(ep)
	if err == nil && c.shared {
		log = sharedLog{log}
	}
	return log, data, err
}

// sharedLog hides a log's Exclusive.
type sharedLog struct{ Log }

// A ledger file is written only through the ledger holding its lock, so
// its Refresh reads nothing (a restore refreshes every episode's ledger,
// and read each whole file before); a log that may have other writers is
// read again, and only used when it changed.
func TestRefreshReadsOnlyWhatOthersMayWrite(t *testing.T) {
	for _, shared := range []bool{false, true} {
		s := &counting{Files: Files(t.TempDir()), shared: shared}
		l := openIn(t, s, "ep")
		mustAppend(t, l, entry("ep/1", chat("1")))
		mustAppend(t, l, entry("ep/2", chat("2")))
		tip := l.Tip()
		if err := l.Refresh(); err != nil || l.Len() != 2 || l.Tip() != tip {
			t.Fatalf("shared %v: refresh: %d entries, %v", shared, l.Len(), err)
		}
		if want := map[bool]int{false: 0, true: 1}[shared]; s.reads != want {
			t.Fatalf("shared %v: the refresh read the ledger %d times, want %d", shared, s.reads, want)
		}
		mustAppend(t, l, entry("ep/3", chat("3")))
		checkCounts(t, s, "ep")
	}
}

// countingPG is the PostgreSQL storage, counting its ReadAll calls.
type countingPG struct {
	*Postgres
	reads int
}

func (c *countingPG) ReadAll(ep string) ([]byte, error) {
	c.reads++
	return c.Postgres.ReadAll(ep)
}

// A ledger in PostgreSQL, which several gateways write, is read again by
// a refresh only when its length there has changed: another node
// appended. Unchanged, only its head row is asked.
func TestRefreshOfASharedLedgerReadsOnlyWhenItGrew(t *testing.T) {
	s := &countingPG{Postgres: openPostgres(t, pgtest.DSN(t))}
	a := openIn(t, s, "ep")
	mustAppend(t, a, entry("ep/1", chat("1")))
	if err := a.Refresh(); err != nil || a.Len() != 1 || s.reads != 0 {
		t.Fatalf("refresh of an unchanged ledger: %d entries, %d reads, %v", a.Len(), s.reads, err)
	}
	b := openIn(t, s, "ep")
	mustAppend(t, b, entry("ep/2", chat("2")))
	if err := a.Refresh(); err != nil || s.reads != 1 || seqs(a.Entries()) != "1:ep/1 2:ep/2" || a.Tip() != b.Tip() {
		t.Fatalf("refresh after another writer's append: %s, %d reads, %v", seqs(a.Entries()), s.reads, err)
	}
	mustAppend(t, a, entry("ep/3", chat("3")))
	checkCounts(t, s, "ep")
}

// BenchmarkRefresh: a restore's refresh of a ledger of 64 entries of 128
// KiB answers (about as large as the soak's ledgers grow), by the ledger
// holding the file's lock (exclusive) against the same file read again
// and compared (read, the baseline: what every refresh did before).
func BenchmarkRefresh(b *testing.B) {
	answer := strings.Repeat("x", 128<<10)
	for _, shared := range []bool{false, true} {
		name := map[bool]string{false: "exclusive", true: "read"}[shared]
		b.Run(name, func(b *testing.B) {
			s := &counting{Files: Files(b.TempDir()), shared: shared}
			l, err := OpenIn(s, "ep")
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			for i := range 64 {
				if _, err := l.Append(entry(fmt.Sprintf("ep/%d", i+1), chat(answer))); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := l.Refresh(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkRewindCheck is what a restore asks of each episode that made
// calls since the checkpoint: does the ledger still hold the checkpoint's
// history? HistoryAt answers from the ledger's state; EntriesAt, which the
// restore used before, reads and parses the ledger up to the checkpoint's
// tip (the baseline). The ledger is 64 answers of 128 KiB (8 MiB) with the
// checkpoint half way.
func BenchmarkRewindCheck(b *testing.B) {
	answer := strings.Repeat("x", 128<<10)
	l, err := OpenIn(Files(b.TempDir()), "ep")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	var at Tip
	for i := range 64 {
		if _, err := l.Append(entry(fmt.Sprintf("ep/%d", i+1), chat(answer))); err != nil {
			b.Fatal(err)
		}
		if i == 31 {
			at = l.Tip()
		}
	}
	b.Run("history-at", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if n, _, err := l.HistoryAt(at.Hash); err != nil || n != 32 {
				b.Fatal(n, err)
			}
		}
	})
	b.Run("entries-at", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if past, err := l.EntriesAt(at.Hash); err != nil || len(past) != 32 {
				b.Fatal(len(past), err)
			}
		}
	})
}

// A ledger whose restores went back and forth between checkpoints holds
// branches that each go back past the branch before. Opening it walks its
// bytes once, not once more for every branch before each branch (which
// doubles with every branch: twelve took 4,096 walks, and thirty would
// take hours), and comes to the same state as going back to each
// branch's record by loading the bytes up to there.
func TestBranchesLoadInOneWalk(t *testing.T) {
	const k = 12
	dir := t.TempDir()
	l, err := Open(dir, "ep")
	if err != nil {
		t.Fatal(err)
	}
	for i := range k {
		e := mustAppend(t, l, entry(fmt.Sprintf("ep/%d", i+1), chat("x")))
		if i%3 == 0 {
			if err := l.Settle(Settlement{Seq: e.Seq, CallID: e.CallID, Disposition: Delivered}); err != nil {
				t.Fatal(err)
			}
		}
		tip := l.Tip() // a checkpoint
		if err := l.Cut(int64(i/2), "restore of an earlier checkpoint"); err != nil {
			t.Fatal(err)
		}
		mustAppend(t, l, entry(fmt.Sprintf("ep/dead-%d", i+1), chat("x")))
		if err := l.Branch(tip.Hash, "restore of that checkpoint"); err != nil {
			t.Fatal(err)
		}
	}
	want := seqs(l.Entries())
	checkHistoryAt(t, l, Files(dir))
	l.Close()

	loads.Store(0)
	l, err = Open(dir, "ep")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if n := loads.Load(); n != 1 {
		t.Fatalf("opening a ledger of %d branches walked its bytes %d times, want once", k, n)
	}
	if got := seqs(l.Entries()); got != want {
		t.Fatalf("after reopening: %s, want %s", got, want)
	}
	checkOneWalk(t, fileBytes(t, dir, "ep"))
}

// checkOneWalk holds the load of data, which keeps the state at each
// branch's record as it walks past, to the load that loads the bytes up
// to each branch's record again.
func checkOneWalk(t *testing.T, data []byte) {
	t.Helper()
	fast, prob := load(data, "ep", true)
	if prob != nil {
		t.Fatal(prob)
	}
	scanBranches = false
	slow, prob := load(data, "ep", true)
	scanBranches = true
	if prob != nil {
		t.Fatal(prob)
	}
	if !reflect.DeepEqual(fast, slow) {
		t.Fatalf("the state kept as the walk passed each branch's record differs from the one loaded up to there:\n%+v\n%+v", fast, slow)
	}
}

// BenchmarkLoadBranched loads a ledger of 16 branches that each go back
// past the one before (restores back and forth between checkpoints):
// "one-walk" as Open does, "reload-each" loading the bytes up to each
// branch's record again (the baseline, as Open did before).
func BenchmarkLoadBranched(b *testing.B) {
	dir := b.TempDir()
	l, err := Open(dir, "ep")
	if err != nil {
		b.Fatal(err)
	}
	for i := range 16 {
		if _, err := l.Append(entry(fmt.Sprintf("ep/%d", i+1), chat(strings.Repeat("x", 4<<10)))); err != nil {
			b.Fatal(err)
		}
		tip := l.Tip()
		if err := l.Cut(int64(i/2), "restore"); err != nil {
			b.Fatal(err)
		}
		if err := l.Branch(tip.Hash, "restore"); err != nil {
			b.Fatal(err)
		}
	}
	l.Close()
	data, err := Files(dir).ReadAll("ep")
	if err != nil {
		b.Fatal(err)
	}
	for _, scan := range []bool{true, false} {
		b.Run(map[bool]string{true: "one-walk", false: "reload-each"}[scan], func(b *testing.B) {
			scanBranches = scan
			defer func() { scanBranches = true }()
			b.ReportAllocs()
			for b.Loop() {
				if _, prob := load(data, "ep", false); prob != nil {
					b.Fatal(prob)
				}
			}
		})
	}
}
