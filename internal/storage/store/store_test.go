package store

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"reflect"
	"stasis/errdefs"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func rec(episode, snapshot string) Record {
	w, u := 1796202672.804, 1967.18
	return Record{
		Episode: episode, Provider: "local", Sandbox: json.RawMessage(`{"id":"sb-` + episode + `"}`),
		SnapshotID: snapshot, KeepsProcesses: true, PauseSeq: 1, PauseMode: PauseStop, PauseConfirmed: true,
		Identity: &Identity{PID: 100, StartTime: 7}, PauseWall: &w, PauseUptime: &u,
	}
}

// save begins checkpoint id, puts one record per snapshot and commits.
func save(t *testing.T, s Store, id string, snapshots ...string) {
	t.Helper()
	ctx := context.Background()
	if err := s.Begin(ctx, id, json.RawMessage(`{"step":1}`)); err != nil {
		t.Fatal(err)
	}
	for i, snap := range snapshots {
		if err := s.Put(ctx, id, rec(fmt.Sprintf("ep-%d", i), snap)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Commit(ctx, id, len(snapshots)); err != nil {
		t.Fatal(err)
	}
}

func testSaveAndRead(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	if _, err := s.Latest(ctx); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Latest of an empty store: %v", err)
	}
	save(t, s, "A", "snap-1", "snap-2")
	if err := s.Begin(ctx, "A", nil); !errors.Is(err, errdefs.ErrExists) || !strings.Contains(err.Error(), `"A"`) {
		t.Fatalf("Begin of an existing id: %v", err)
	}
	for _, bad := range []string{"", "has space", "a/b"} {
		if err := s.Begin(ctx, bad, nil); err == nil {
			t.Errorf("Begin(%q) accepted", bad)
		}
	}
	if err := s.Begin(ctx, "X", json.RawMessage(`{`)); err == nil {
		t.Error("a manifest that is not JSON was accepted")
	}
	c, recs, err := s.Get(ctx, "A")
	if err != nil {
		t.Fatal(err)
	}
	if c.ID != "A" || c.State != StateCommitted || c.Episodes != 2 || c.Committed == nil || string(c.Manifest) != `{"step":1}` || c.Error != "" {
		t.Fatalf("checkpoint %+v", c)
	}
	if len(recs) != 2 || recs[0].Episode != "ep-0" || recs[1].SnapshotID != "snap-2" || !recs[0].RestoresInPlace() {
		t.Fatalf("records %+v", recs)
	}
	if !recordsEqual(recs[0], mustDecode(t, rec("ep-0", "snap-1"))) {
		t.Fatalf("stored record differs: %+v", recs[0])
	}
	if _, _, err := s.Get(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), `"nope"`) {
		t.Fatalf("Get of an unknown id: %v", err)
	}

	// Unknown fields of a record survive the store.
	if err := s.Begin(ctx, "B", nil); err != nil {
		t.Fatal(err)
	}
	r, err := DecodeRecord([]byte(fullRecord))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Put(ctx, "B", r); err != nil {
		t.Fatal(err)
	}
	// A record a restore could not use is refused.
	if err := s.Put(ctx, "B", Record{Episode: "ep-x", Provider: "local"}); !errors.Is(err, ErrRecord) {
		t.Fatalf("Put of a record without a snapshot: %v", err)
	}
	if err := s.Commit(ctx, "B", 1); err != nil {
		t.Fatal(err)
	}
	// Reopening finds everything, and the schema is not created twice.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	_, recs, err = s2.Get(ctx, "B")
	if err != nil || len(recs) != 1 || !recordsEqual(recs[0], r) || !reflect.DeepEqual(recs[0].Unknown(), []string{"ledger_shard", "zz_note"}) {
		t.Fatalf("after reopening: %+v %v", recs, err)
	}
	if l, err := s2.Latest(ctx); err != nil || l.ID != "B" {
		t.Fatalf("Latest %+v %v", l, err)
	}
	var v int
	if err := s2.db.QueryRow(`SELECT version FROM schema_version`).Scan(&v); err != nil || v != len(migrations) {
		t.Fatalf("schema version %d %v", v, err)
	}
}

func mustDecode(t *testing.T, r Record) Record {
	t.Helper()
	b, err := r.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	r, err = DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func testNewerSchemaIsRefused(t *testing.T, be backend) {
	s, path := be.openTemp(t)
	if _, err := s.db.Exec(`UPDATE schema_version SET version = 99`); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	_, err := be.open(path)
	if err == nil || !strings.Contains(err.Error(), "schema version 99, newer than this stasis understands") || !strings.Contains(err.Error(), "upgrade stasis") {
		t.Fatalf("opening a newer store: %v", err)
	}
}

func testCommitIsAllOrNothing(t *testing.T, be backend) {
	ctx := context.Background()
	s, _ := be.openTemp(t)
	save(t, s, "A", "snap-1", "snap-2")

	if err := s.Begin(ctx, "B", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(ctx, "B", rec("ep-0", "snap-3")); err != nil {
		t.Fatal(err)
	}
	err := s.Commit(ctx, "B", 2)
	if !errors.Is(err, ErrIncomplete) || !strings.Contains(err.Error(), "1 records are there, 2 were expected") || !strings.Contains(err.Error(), "marked failed") {
		t.Fatalf("commit with a record missing: %v", err)
	}
	b, _, err := s.Get(ctx, "B")
	if err != nil || b.State != StateFailed || b.Committed != nil || !strings.Contains(b.Error, "2 were expected") {
		t.Fatalf("B after a refused commit: %+v %v", b, err)
	}
	if l, err := s.Latest(ctx); err != nil || l.ID != "A" {
		t.Fatalf("Latest after a failed save: %+v %v", l, err)
	}
	a, recs, err := s.Get(ctx, "A")
	if err != nil || a.State != StateCommitted || len(recs) != 2 {
		t.Fatalf("A after a failed save: %+v %d %v", a, len(recs), err)
	}

	// Nothing changes a committed or failed checkpoint's records.
	for _, id := range []string{"A", "B"} {
		if err := s.Put(ctx, id, rec("ep-9", "snap-9")); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "pending") {
			t.Errorf("Put into %s: %v", id, err)
		}
		if err := s.Commit(ctx, id, 2); !errors.Is(err, errdefs.ErrConflict) {
			t.Errorf("Commit of %s again: %v", id, err)
		}
	}
	if err := s.Fail(ctx, "A", "no"); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("Fail of a committed checkpoint: %v", err)
	}
	if err := s.Fail(ctx, "B", "again"); err != nil {
		t.Errorf("Fail of a failed checkpoint: %v", err)
	}
	if err := s.Put(ctx, "nope", rec("ep-0", "s")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Put into an unknown checkpoint: %v", err)
	}

	// Too many records fail the commit too; Fail marks a pending one.
	if err := s.Begin(ctx, "C", nil); err != nil {
		t.Fatal(err)
	}
	for _, ep := range []string{"ep-0", "ep-1"} {
		if err := s.Put(ctx, "C", rec(ep, "snap-c")); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Commit(ctx, "C", 1); !errors.Is(err, ErrIncomplete) {
		t.Fatalf("commit with a record too many: %v", err)
	}
	if err := s.Begin(ctx, "D", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Fail(ctx, "D", "snapshot of ep-3 failed"); err != nil {
		t.Fatal(err)
	}
	if d, _, _ := s.Get(ctx, "D"); d.State != StateFailed || d.Error != "snapshot of ep-3 failed" {
		t.Fatalf("D %+v", d)
	}

	// A record that went bad in the database fails the commit.
	if err := s.Begin(ctx, "E", nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(ctx, "E", rec("ep-0", "snap-e")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.db.Exec(s.q(`UPDATE records SET doc = ? WHERE checkpoint_id = 'E'`), `{"schema":7,"episode":"ep-0"}`); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "E", 1); !errors.Is(err, ErrIncomplete) || !strings.Contains(err.Error(), "schema 7") {
		t.Fatalf("commit of a record of an unknown schema: %v", err)
	}
	if l, _ := s.Latest(ctx); l.ID != "A" {
		t.Fatalf("Latest is %s", l.ID)
	}
}

func testListAndRecoverPending(t *testing.T, be backend) {
	ctx := context.Background()
	s, _ := be.openTemp(t)
	save(t, s, "A", "s1")
	save(t, s, "B", "s2")
	if err := s.Begin(ctx, "C", nil); err != nil {
		t.Fatal(err)
	}
	ids := func(cs []Checkpoint) string {
		var out []string
		for _, c := range cs {
			out = append(out, c.ID)
		}
		return strings.Join(out, ",")
	}
	all, err := s.List(ctx, ListOptions{})
	if err != nil || ids(all) != "C,B,A" {
		t.Fatalf("List: %s %v", ids(all), err)
	}
	if cs, _ := s.List(ctx, ListOptions{State: StateCommitted, Limit: 1}); ids(cs) != "B" {
		t.Fatalf("List committed limit 1: %s", ids(cs))
	}
	if _, err := s.List(ctx, ListOptions{State: "done"}); err == nil {
		t.Fatal("List of an unknown state accepted")
	}
	if failed, err := s.RecoverPending(ctx, time.Hour); err != nil || len(failed) != 0 {
		t.Fatalf("RecoverPending(1h) of a fresh save: %v %v", failed, err)
	}
	if failed, err := s.RecoverPending(ctx, 0); err != nil || !reflect.DeepEqual(failed, []string{"C"}) {
		t.Fatalf("RecoverPending(0): %v %v", failed, err)
	}
	if cs, _ := s.List(ctx, ListOptions{State: StatePending}); len(cs) != 0 {
		t.Fatalf("still pending: %s", ids(cs))
	}
}

func testDeleteFreesOnlyUnreferencedSnapshots(t *testing.T, be backend) {
	ctx := context.Background()
	s, _ := be.openTemp(t)
	save(t, s, "A", "s1", "s2")
	save(t, s, "B", "s2", "s3")
	// C is pending and references s3 and s4; its ep-0 first had s5.
	if err := s.Begin(ctx, "C", nil); err != nil {
		t.Fatal(err)
	}
	for _, r := range []Record{rec("ep-0", "s5"), rec("ep-0", "s3"), rec("ep-1", "s4")} {
		if err := s.Put(ctx, "C", r); err != nil {
			t.Fatal(err)
		}
	}
	// The same snapshot id at another provider is another snapshot.
	if err := s.Begin(ctx, "D", nil); err != nil {
		t.Fatal(err)
	}
	other := rec("ep-0", "s1")
	other.Provider = "e2b"
	if err := s.Put(ctx, "D", other); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "D", 1); err != nil {
		t.Fatal(err)
	}

	if _, err := s.Delete(ctx, "C"); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "pending") {
		t.Fatalf("Delete of a pending checkpoint: %v", err)
	}
	if _, err := s.Delete(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Delete of an unknown checkpoint: %v", err)
	}
	local := func(ids ...string) []SnapshotRef {
		var out []SnapshotRef
		for _, id := range ids {
			out = append(out, SnapshotRef{"local", id})
		}
		return out
	}
	check := func(id string, want []SnapshotRef) {
		t.Helper()
		freed, err := s.Delete(ctx, id)
		if err != nil || !reflect.DeepEqual(freed, want) {
			t.Fatalf("Delete(%s) freed %v (%v), want %v", id, freed, err, want)
		}
		if _, _, err := s.Get(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s still there: %v", id, err)
		}
	}
	check("A", local("s1")) // s2 is still B's
	check("B", local("s2")) // s3 is still pending C's
	check("D", []SnapshotRef{{"e2b", "s1"}})
	if err := s.Fail(ctx, "C", "abandoned"); err != nil {
		t.Fatal(err)
	}
	check("C", local("s3", "s4")) // s5 was replaced before C failed
	var n int
	if err := s.db.QueryRow(`SELECT (SELECT COUNT(*) FROM records) + (SELECT COUNT(*) FROM snapshot_refs) + (SELECT COUNT(*) FROM checkpoints)`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("rows left: %d %v", n, err)
	}
}

func testConcurrentPuts(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	// A second handle on the same file, as another process would have.
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if err := s.Begin(ctx, "A", nil); err != nil {
		t.Fatal(err)
	}
	const writers, each = 8, 20
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := Store(s)
			if w%2 == 1 {
				st = s2
			}
			for i := range each {
				ep := fmt.Sprintf("ep-%d-%d", w, i)
				// Write each twice: the second replaces the first.
				for _, snap := range []string{"old-" + ep, "snap-" + ep} {
					if err := st.Put(ctx, "A", rec(ep, snap)); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	// Readers meanwhile see a pending checkpoint, never a committed one.
	done := make(chan struct{})
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			c, _, err := s2.Get(ctx, "A")
			if err != nil || c.State != StatePending {
				errs <- fmt.Errorf("reader saw %+v, %v", c, err)
				return
			}
		}
	}()
	wg.Wait()
	close(done)
	rwg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "A", writers*each); err != nil {
		t.Fatal(err)
	}
	_, recs, err := s2.Get(ctx, "A")
	if err != nil || len(recs) != writers*each {
		t.Fatalf("%d records, %v", len(recs), err)
	}
	for _, r := range recs {
		if r.SnapshotID != "snap-"+r.Episode {
			t.Fatalf("record %s kept snapshot %s", r.Episode, r.SnapshotID)
		}
	}
	freed, err := s.Delete(ctx, "A")
	if err != nil || len(freed) != writers*each {
		t.Fatalf("Delete freed %d snapshots, want %d (the replaced ones are no longer referenced): %v", len(freed), writers*each, err)
	}
}

// saverEnv makes the test binary act as a save that never finishes.
const saverEnv = "STASIS_STORE_TEST_SAVER"

func testInterruptedSaveKeepsPreviousCheckpoint(t *testing.T, be backend) {
	if path := os.Getenv(saverEnv); path != "" {
		saveUntilKilled(path)
		return
	}
	ctx := context.Background()
	s, path := be.openTemp(t)
	save(t, s, "A", "snap-a0", "snap-a1")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^"+strings.ReplaceAll(t.Name(), "/", "$/^")+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), saverEnv+"="+path)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	deadline := time.After(60 * time.Second)
wait:
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				_ = cmd.Wait()
				t.Fatalf("the saver ended before it was killed: %s", stderr.String())
			}
			if l == "saving" {
				break wait
			}
		case <-deadline:
			t.Fatalf("the saver did not start saving within 60s: %s", stderr.String())
		}
	}
	// The saver is in its Put loop: kill it mid-save.
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for range lines {
	}
	err = cmd.Wait()
	killed = true
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the saver was not killed by SIGKILL: %v", err)
	}

	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if l, err := s2.Latest(ctx); err != nil || l.ID != "A" {
		t.Fatalf("Latest after an interrupted save: %+v %v", l, err)
	}
	a, recs, err := s2.Get(ctx, "A")
	if err != nil || a.State != StateCommitted || len(recs) != 2 {
		t.Fatalf("A after an interrupted save: %+v %d %v", a, len(recs), err)
	}
	b, recs, err := s2.Get(ctx, "B")
	if err != nil || b.State != StatePending || len(recs) < 3 {
		t.Fatalf("B after an interrupted save: %+v %d records, %v", b, len(recs), err)
	}
	t.Logf("the save was killed after %d durable records", len(recs))
	failed, err := s2.RecoverPending(ctx, 0)
	if err != nil || !reflect.DeepEqual(failed, []string{"B"}) {
		t.Fatalf("RecoverPending: %v %v", failed, err)
	}
	b, _, err = s2.Get(ctx, "B")
	if err != nil || b.State != StateFailed || !strings.Contains(b.Error, "interrupted save") {
		t.Fatalf("B after recovery: %+v %v", b, err)
	}
	if err := s2.Commit(ctx, "B", len(recs)); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("commit of a recovered save: %v", err)
	}
	if l, err := s2.Latest(ctx); err != nil || l.ID != "A" {
		t.Fatalf("Latest after recovery: %+v %v", l, err)
	}
}

// saveUntilKilled begins checkpoint B and writes records to it until the
// process is killed; it prints "saving" once three records are durable.
func saveUntilKilled(path string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "saver:", err)
		os.Exit(1)
	}
	ctx := context.Background()
	s, err := OpenAt(ctx, path)
	if err != nil {
		fail(err)
	}
	if err := s.Begin(ctx, "B", nil); err != nil {
		fail(err)
	}
	for i := 0; ; i++ {
		if err := s.Put(ctx, "B", rec(fmt.Sprintf("ep-%06d", i), fmt.Sprintf("snap-b%d", i))); err != nil {
			fail(err)
		}
		if i == 2 {
			fmt.Println("saving")
		}
	}
}

// The SQL must not rely on SQLite alone: placeholders are rewritten for
// PostgreSQL, and every statement uses only portable types.
func TestSQLIsPortable(t *testing.T) {
	pg := &sqlStore{d: dialect{name: "postgres", dollarPlaceholders: true, forUpdate: " FOR UPDATE"}}
	if got := pg.q(`SELECT a FROM t WHERE x = ? AND y = ?`); got != `SELECT a FROM t WHERE x = $1 AND y = $2` {
		t.Fatalf("rewritten: %s", got)
	}
	for _, step := range migrations {
		for _, stmt := range step {
			up := strings.ToUpper(stmt)
			for _, word := range []string{"AUTOINCREMENT", "WITHOUT ROWID", "STRICT", "PRAGMA", "DATETIME(", "BLOB", "REAL"} {
				if strings.Contains(up, word) {
					t.Errorf("schema uses %s, which PostgreSQL lacks: %s", word, stmt)
				}
			}
		}
	}
}

// A verdict is written once: later puts, concurrent or after a reopen,
// return the first document and change nothing.
func testVerdictOnce(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	if _, err := s.GetVerdict(ctx, "ep-1", 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetVerdict before any: %v", err)
	}
	if _, _, err := s.PutVerdict(ctx, "ep-1", 0, json.RawMessage(`{"reward":`)); err == nil {
		t.Fatal("PutVerdict took invalid JSON")
	}
	var wg sync.WaitGroup
	var createdN atomic.Int32
	docs := make([]string, 8)
	for i := range docs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			doc := fmt.Sprintf(`{"reward":1,"writer":%d}`, i)
			got, created, err := s.PutVerdict(ctx, "ep-1", 0, json.RawMessage(doc))
			if err != nil {
				t.Error(err)
				return
			}
			if created {
				createdN.Add(1)
				if string(got) != doc {
					t.Errorf("created %s, returned %s", doc, got)
				}
			}
			docs[i] = string(got)
		}()
	}
	wg.Wait()
	if createdN.Load() != 1 {
		t.Fatalf("%d puts created the verdict, want 1", createdN.Load())
	}
	for _, d := range docs[1:] {
		if d != docs[0] {
			t.Fatalf("puts returned different verdicts: %q", docs)
		}
	}
	_ = s.Close()
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	got, created, err := s2.PutVerdict(ctx, "ep-1", 0, json.RawMessage(`{"reward":0}`))
	if err != nil || created || string(got) != docs[0] {
		t.Fatalf("put after reopen: %s %v %v", got, created, err)
	}
	if g, err := s2.GetVerdict(ctx, "ep-1", 0); err != nil || string(g) != docs[0] {
		t.Fatalf("GetVerdict: %s %v", g, err)
	}
	// The next attempt (after a restore) has a verdict of its own.
	if _, err := s2.GetVerdict(ctx, "ep-1", 1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetVerdict of attempt 1 before any: %v", err)
	}
	if got, created, err := s2.PutVerdict(ctx, "ep-1", 1, json.RawMessage(`{"reward":0}`)); err != nil || !created || string(got) != `{"reward":0}` {
		t.Fatalf("put of attempt 1: %s %v %v", got, created, err)
	}
	if g, err := s2.GetVerdict(ctx, "ep-1", 0); err != nil || string(g) != docs[0] {
		t.Fatalf("attempt 0 after attempt 1's put: %s %v", g, err)
	}
	if _, _, err := s2.PutVerdict(ctx, "ep-1", -1, json.RawMessage(`{}`)); err == nil {
		t.Fatal("PutVerdict took a negative attempt")
	}
}

// A store made by schema 3 keeps its verdicts, as attempt 0's.
func testMigrateVerdictsToAttempts(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	rollBack(t, s, 4)
	for _, stmt := range []string{
		`DROP TABLE verdicts`,
		`CREATE TABLE verdicts (episode TEXT NOT NULL PRIMARY KEY, created_ns BIGINT NOT NULL, doc TEXT NOT NULL)`,
		`INSERT INTO verdicts (episode, created_ns, doc) VALUES ('ep-old', 1, '{"reward":1}')`,
		`UPDATE schema_version SET version = 3`,
	} {
		if _, err := s.db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	_ = s.Close()
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if g, err := s2.GetVerdict(ctx, "ep-old", 0); err != nil || string(g) != `{"reward":1}` {
		t.Fatalf("the old verdict: %s %v", g, err)
	}
	if _, err := s2.GetVerdict(ctx, "ep-old", 1); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("attempt 1: %v", err)
	}
}

// A store made by the first schema gains the verdicts table on open and
// keeps its checkpoints.
func testMigrateFromSchema1(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	save(t, s, "A", "snap-1")
	rollBack(t, s, 4)
	for _, stmt := range []string{`DROP TABLE verdicts`, `DROP TABLE episodes`} {
		if _, err := s.db.Exec(stmt); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.db.Exec(`UPDATE schema_version SET version = 1`); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, _, err := s2.Get(ctx, "A"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s2.PutVerdict(ctx, "ep", 0, json.RawMessage(`{}`)); err != nil {
		t.Fatal(err)
	}
}

func testEpisodes(t *testing.T, be backend) {
	ctx := context.Background()
	s, path := be.openTemp(t)
	if _, err := s.GetEpisode(ctx, "ep-1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetEpisode of none: %v", err)
	}
	if err := s.PutEpisode(ctx, Episode{ID: "ep-1", State: "paused"}); err == nil {
		t.Fatal("took an unknown state")
	}
	for _, id := range []string{"ep-1", "ep-2"} {
		if err := s.PutEpisode(ctx, Episode{ID: id, Task: "t", Harness: "mini", Provider: "local", Sandbox: "sb-" + id, State: EpisodeRunning}); err != nil {
			t.Fatal(err)
		}
	}
	e, _ := s.GetEpisode(ctx, "ep-1")
	e.State, e.Attempt = EpisodeEnded, 2
	if err := s.PutEpisode(ctx, e); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	s2, err := be.open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	all, err := s2.ListEpisodes(ctx, "")
	if err != nil || len(all) != 2 || all[0].ID != "ep-1" || all[0].Attempt != 2 || !all[0].Created.Equal(e.Created) {
		t.Fatalf("ListEpisodes: %+v %v", all, err)
	}
	running, err := s2.ListEpisodes(ctx, EpisodeRunning)
	if err != nil || len(running) != 1 || running[0].ID != "ep-2" || running[0].Sandbox != "sb-ep-2" {
		t.Fatalf("running episodes: %+v %v", running, err)
	}
}
