package store

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"stasis/errdefs"

	"stasis/internal/pgtest"
	"stasis/internal/testsvc"
)

func TestMain(m *testing.M) { testsvc.Main(m) }

// backend is one engine the store's tests run on: every Store behaviour
// holds alike on SQLite and on a real PostgreSQL server.
type backend struct {
	name string
	// location makes a new, empty store's location for the test.
	location func(t *testing.T) string
}

var backends = []backend{
	{"sqlite", func(t *testing.T) string { return filepath.Join(t.TempDir(), "store.db") }},
	{"postgres", func(t *testing.T) string { return pgtest.DSN(t) }},
}

// open opens the store at location, as OpenAt does.
func (b backend) open(location string) (*sqlStore, error) {
	s, err := OpenAt(context.Background(), location)
	if err != nil {
		return nil, err
	}
	switch s := s.(type) {
	case *SQLite:
		return &s.sqlStore, nil
	case *Postgres:
		return &s.sqlStore, nil
	}
	return nil, fmt.Errorf("OpenAt(%q) gave a %T", location, s)
}

// openTemp opens a new, empty store, closed when the test ends, and
// returns it with its location.
func (b backend) openTemp(t *testing.T) (*sqlStore, string) {
	t.Helper()
	loc := b.location(t)
	s, err := b.open(loc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, loc
}

// undo undoes each migration from 5 on: undo[i] takes schema i+1 back to i.
var undo = map[int][]string{
	5: {`DROP TABLE journal`},
	6: {`DROP TABLE nodes`},
	7: {`DROP TABLE checkpoint_shares`, `ALTER TABLE checkpoints DROP COLUMN node`},
	8: {`DROP TABLE restore_shares`, `DROP TABLE restores`},
}

// rollBack takes s's schema back to version, as an older stasis left it.
func rollBack(t *testing.T, s *sqlStore, version int) {
	t.Helper()
	for v := len(migrations); v > version; v-- {
		stmts, ok := undo[v]
		if !ok {
			t.Fatalf("the test cannot undo schema version %d: add it to undo", v)
		}
		for _, stmt := range stmts {
			if _, err := s.db.Exec(stmt); err != nil {
				t.Fatalf("undo schema %d: %s: %v", v, stmt, err)
			}
		}
	}
	if _, err := s.db.Exec(s.q(`UPDATE schema_version SET version = ?`), version); err != nil {
		t.Fatal(err)
	}
}

// storeTests are the behaviour tests every backend passes.
var storeTests = []struct {
	name string
	fn   func(*testing.T, backend)
}{
	{"SaveAndRead", testSaveAndRead},
	{"NewerSchemaIsRefused", testNewerSchemaIsRefused},
	{"CommitIsAllOrNothing", testCommitIsAllOrNothing},
	{"ListAndRecoverPending", testListAndRecoverPending},
	{"DeleteFreesOnlyUnreferencedSnapshots", testDeleteFreesOnlyUnreferencedSnapshots},
	{"ConcurrentPuts", testConcurrentPuts},
	{"InterruptedSaveKeepsPreviousCheckpoint", testInterruptedSaveKeepsPreviousCheckpoint},
	{"VerdictOnce", testVerdictOnce},
	{"MigrateVerdictsToAttempts", testMigrateVerdictsToAttempts},
	{"MigrateFromSchema1", testMigrateFromSchema1},
	{"Episodes", testEpisodes},
	{"Journal", testJournal},
	{"MigrateToJournal", testMigrateToJournal},
	{"RacingCommits", testRacingCommits},
	{"ConcurrentOpen", testConcurrentOpen},
}

func TestStore(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			for _, tt := range storeTests {
				t.Run(tt.name, func(t *testing.T) { tt.fn(t, b) })
			}
		})
	}
}

// Stores on one database racing to commit the same checkpoint: exactly one
// commits it, the others are told it is no longer pending, and the
// checkpoint is the same whoever won.
func testRacingCommits(t *testing.T, be backend) {
	ctx := context.Background()
	s, loc := be.openTemp(t)
	if err := s.Begin(ctx, "A", nil); err != nil {
		t.Fatal(err)
	}
	const n = 4
	for i := range n {
		if err := s.Put(ctx, "A", rec(fmt.Sprintf("ep-%d", i), fmt.Sprintf("snap-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	handles := []*sqlStore{s}
	for range 3 {
		h, err := be.open(loc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = h.Close() })
		handles = append(handles, h)
	}
	errs := make(chan error, len(handles))
	var wg sync.WaitGroup
	for _, h := range handles {
		wg.Go(func() { errs <- h.Commit(ctx, "A", n) })
	}
	wg.Wait()
	close(errs)
	won := 0
	for err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "it is committed"):
			t.Errorf("a losing commit: %v", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d commits won, want exactly 1", won)
	}
	c, recs, err := s.Get(ctx, "A")
	if err != nil || c.State != StateCommitted || len(recs) != n {
		t.Fatalf("after the race: %+v, %d records, %v", c, len(recs), err)
	}
}

// Servers starting at once on a new database migrate it once between them.
func testConcurrentOpen(t *testing.T, be backend) {
	loc := be.location(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			s, err := be.open(loc)
			if err == nil {
				err = s.Close()
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	s, _ := be.open(loc)
	defer s.Close()
	var v, rows int
	if err := s.db.QueryRow(`SELECT MAX(version), COUNT(*) FROM schema_version`).Scan(&v, &rows); err != nil || v != len(migrations) || rows != 1 {
		t.Fatalf("schema_version: version %d in %d rows, %v", v, rows, err)
	}
}
