package store

import (
	"context"
	"encoding/json"
	"errors"
	"stasis/errdefs"
	"strings"
	"testing"
)

// TestJournal runs the journal's conformance checks on the SQLite store.
func testJournal(t *testing.T, be backend) {
	journalConformance(t, func(t *testing.T) (Store, func() Store) {
		s, path := be.openTemp(t)
		return s, func() Store {
			s2, err := be.open(path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s2.Close() })
			return s2
		}
	})
}

// journalConformance is what every Store's journal must do: entries kept
// in the order appended, across a reopen; CloseJournal removing one
// operation's entries and putting its episodes in one transaction (a bad
// episode closes nothing); bad entries refused. open gives a fresh store
// and a function that closes and opens it again on the same data.
func journalConformance(t *testing.T, open func(t *testing.T) (Store, func() Store)) {
	ctx := context.Background()
	s, reopen := open(t)
	if es, err := s.Journal(ctx); err != nil || len(es) != 0 {
		t.Fatalf("the journal of a new store: %+v %v", es, err)
	}
	for _, bad := range []JournalEntry{{Kind: "fork"}, {Op: "op-1"}, {Op: "op-1", Kind: "fork", Doc: json.RawMessage(`{`)}} {
		if _, err := s.AppendJournal(ctx, bad); err == nil {
			t.Errorf("a bad entry %+v was taken", bad)
		}
	}
	add := func(s Store, op, kind, ep, doc string) JournalEntry {
		t.Helper()
		e, err := s.AppendJournal(ctx, JournalEntry{Op: op, Kind: kind, Episode: ep, Doc: json.RawMessage(doc)})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	a1 := add(s, "restore/A", "restore", "", `{"checkpoint":"A"}`)
	b1 := add(s, "prepare/B", "prepare", "", "")
	a2 := add(s, "restore/A", "fork", "ep-1", `{"snapshot":"snap-1"}`)
	if !(a1.Seq < b1.Seq && b1.Seq < a2.Seq) || a1.Created.IsZero() {
		t.Fatalf("entries not ordered as appended: %+v %+v %+v", a1, b1, a2)
	}
	if err := s.(interface{ Close() error }).Close(); err != nil {
		t.Fatal(err)
	}
	s = reopen()
	es, err := s.Journal(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range es {
		got = append(got, e.Op+" "+e.Kind+" "+e.Episode+" "+string(e.Doc))
	}
	want := []string{`restore/A restore  {"checkpoint":"A"}`, `prepare/B prepare  `, `restore/A fork ep-1 {"snapshot":"snap-1"}`}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("after a reopen the journal is\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// A close whose episodes cannot be put changes nothing.
	if err := s.CloseJournal(ctx, "restore/A", []Episode{{ID: "ep-1", State: "paused"}}); err == nil {
		t.Fatal("a close with a bad episode went through")
	}
	if es, _ := s.Journal(ctx); len(es) != 3 {
		t.Fatalf("a failed close removed entries: %+v", es)
	}
	if _, err := s.GetEpisode(ctx, "ep-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a failed close put an episode: %v", err)
	}
	// A close removes its operation's entries and puts its episodes.
	if err := s.CloseJournal(ctx, "restore/A", []Episode{{ID: "ep-1", State: EpisodeRunning, Sandbox: "sb-1", Attempt: 1}}); err != nil {
		t.Fatal(err)
	}
	es, err = s.Journal(ctx)
	if err != nil || len(es) != 1 || es[0].Op != "prepare/B" {
		t.Fatalf("after closing restore/A: %+v %v", es, err)
	}
	if e, err := s.GetEpisode(ctx, "ep-1"); err != nil || e.Sandbox != "sb-1" || e.Attempt != 1 {
		t.Fatalf("the closed operation's episode: %+v %v", e, err)
	}
	// Sequence numbers are never handed out twice while entries remain.
	b2 := add(s, "prepare/B", "snapshot", "ep-2", `{}`)
	if b2.Seq <= b1.Seq {
		t.Fatalf("a new entry's seq %d is not after %d", b2.Seq, b1.Seq)
	}
	if err := s.CloseJournal(ctx, "prepare/B", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseJournal(ctx, "prepare/B", nil); err != nil {
		t.Fatalf("closing a closed operation: %v", err)
	}
	if es, err := s.Journal(ctx); err != nil || len(es) != 0 {
		t.Fatalf("the journal after every close: %+v %v", es, err)
	}
}

// A store of schema 4 gains the journal on open.
func testMigrateToJournal(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	save(t, s, "A", "snap-1")
	rollBack(t, s, 4)
	_ = s.Close()
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, _, err := s2.Get(ctx, "A"); err != nil {
		t.Fatal(err)
	}
	if _, err := s2.AppendJournal(ctx, JournalEntry{Op: "o", Kind: "k"}); err != nil {
		t.Fatal(err)
	}
}

// A node of an older stasis on the same PostgreSQL store numbers its
// journal entries MAX(seq) + 1, taking numbers the sequence would give
// next: an append of this stasis skips them, and both entries are kept.
func TestJournalSkipsNumbersAnOlderNodeTook(t *testing.T) {
	ctx := context.Background()
	s, _ := backends[1].openTemp(t)
	first, err := s.AppendJournal(ctx, JournalEntry{Op: "new/1", Kind: "k"})
	if err != nil {
		t.Fatal(err)
	}
	// The older node's appends, as it made them.
	for i := range 3 {
		if _, err := s.db.ExecContext(ctx, `INSERT INTO journal (seq, op, kind, episode, doc, created_ns, node)
			SELECT MAX(seq) + 1, 'old/1', 'k', '', '', 0, '' FROM journal`); err != nil {
			t.Fatalf("the older node's append %d: %v", i, err)
		}
	}
	next, err := s.AppendJournal(ctx, JournalEntry{Op: "new/1", Kind: "k2"})
	if err != nil {
		t.Fatal(err)
	}
	if next.Seq != first.Seq+4 {
		t.Fatalf("the next append took %d after %d and the older node's three", next.Seq, first.Seq)
	}
	es, err := s.Journal(ctx)
	if err != nil || len(es) != 5 {
		t.Fatalf("journal: %+v %v", es, err)
	}
}
