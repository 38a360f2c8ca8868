package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"stasis/errdefs"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The SQL below is portable between SQLite and PostgreSQL: plain CREATE TABLE
// with TEXT and BIGINT columns, no engine-specific functions, no
// auto-increment, `?` placeholders rewritten per dialect, times as unix
// nanoseconds in BIGINT, and transactions through database/sql. What differs
// between engines is in dialect.

// dialect is what one SQL engine needs done differently.
type dialect struct {
	name string
	// dollarPlaceholders rewrites `?` to $1, $2, ... (PostgreSQL).
	dollarPlaceholders bool
	// forUpdate is appended to the SELECT that reads a checkpoint's state
	// inside a write transaction, to lock its row until the transaction
	// ends (" FOR UPDATE" in PostgreSQL). SQLite needs none: its write
	// transactions begin IMMEDIATE and hold the database's write lock.
	forUpdate string
	// forShare is appended instead by a write that needs the checkpoint
	// to stay as it is but changes only its records (Put): writes of
	// records run side by side, and one that changes the checkpoint
	// (forUpdate) waits for them, or they for it (" FOR SHARE").
	forShare string
	// serialWrites makes write transactions of one process take turns in Go
	// rather than in the engine's lock (SQLite, whose busy handler sleeps).
	serialWrites bool
	// writeIsolation is the isolation of write transactions. SQLite's are
	// serializable whatever is asked; PostgreSQL needs LevelSerializable
	// (and a retry on a serialization failure) so that Delete's "no other
	// checkpoint references this snapshot" cannot race a Put.
	writeIsolation sql.IsolationLevel
	// retry reports whether a write transaction that failed with err
	// should run again (PostgreSQL's serialization failures); nil: never.
	retry func(err error) bool
	// migrateLock, if set, is run first in the migration's transaction to
	// make concurrent migrations of one database take turns.
	migrateLock string
	// journalSeq: the journal's numbers come from the sequence
	// journal_seq (PostgreSQL), which the migration makes if missing,
	// rather than from MAX(seq) + 1. Under serializable isolation every
	// append reading the journal's last number conflicts with every other
	// append, and with many episodes starting at once their retries ran
	// out; a sequence is read by no transaction.
	journalSeq bool
}

var sqliteDialect = dialect{name: "sqlite", serialWrites: true}

// migrations are the schema, one step per version; a step is never changed
// once released, only new steps appended.
var migrations = [][]string{
	{ // 1: checkpoints, their records, the snapshots they reference
		`CREATE TABLE checkpoints (
			id           TEXT NOT NULL PRIMARY KEY,
			created_ns   BIGINT NOT NULL,
			state        TEXT NOT NULL,
			manifest     TEXT NOT NULL,
			error        TEXT NOT NULL,
			committed_ns BIGINT
		)`,
		`CREATE INDEX checkpoints_by_created ON checkpoints (created_ns)`,
		`CREATE TABLE records (
			checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id),
			episode       TEXT NOT NULL,
			provider      TEXT NOT NULL,
			snapshot_id   TEXT NOT NULL,
			doc           TEXT NOT NULL,
			PRIMARY KEY (checkpoint_id, episode)
		)`,
		`CREATE TABLE snapshot_refs (
			checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id),
			provider      TEXT NOT NULL,
			snapshot_id   TEXT NOT NULL,
			PRIMARY KEY (checkpoint_id, provider, snapshot_id)
		)`,
		`CREATE INDEX snapshot_refs_by_snapshot ON snapshot_refs (provider, snapshot_id)`,
	},
	{ // 2: the captured verify result of each episode, written once
		`CREATE TABLE verdicts (
			episode    TEXT NOT NULL PRIMARY KEY,
			created_ns BIGINT NOT NULL,
			doc        TEXT NOT NULL
		)`,
	},
	{ // 3: episodes, so that any server on the store can drive them
		`CREATE TABLE episodes (
			id         TEXT NOT NULL PRIMARY KEY,
			created_ns BIGINT NOT NULL,
			state      TEXT NOT NULL,
			doc        TEXT NOT NULL
		)`,
		`CREATE INDEX episodes_by_state ON episodes (state, created_ns)`,
	},
	{ // 4: a verdict belongs to one attempt of an episode: a restore starts
		// a new attempt, verified afresh. Verdicts recorded before were of
		// the attempt then current; it is not known, so they are kept as
		// attempt 0 (an episode restored since is verified again).
		`CREATE TABLE verdicts_by_attempt (
			episode    TEXT NOT NULL,
			attempt    INTEGER NOT NULL,
			created_ns BIGINT NOT NULL,
			doc        TEXT NOT NULL,
			PRIMARY KEY (episode, attempt)
		)`,
		`INSERT INTO verdicts_by_attempt (episode, attempt, created_ns, doc) SELECT episode, 0, created_ns, doc FROM verdicts`,
		`DROP TABLE verdicts`,
		`ALTER TABLE verdicts_by_attempt RENAME TO verdicts`,
	},
	{ // 5: the journal of the coordinator's operations under way: what a
		// prepare or a restore is about to create, written before it is
		// created, so that the next server finishes or undoes it.
		`CREATE TABLE journal (
			seq        BIGINT NOT NULL PRIMARY KEY,
			op         TEXT NOT NULL,
			kind       TEXT NOT NULL,
			episode    TEXT NOT NULL,
			doc        TEXT NOT NULL,
			created_ns BIGINT NOT NULL
		)`,
		`CREATE INDEX journal_by_op ON journal (op, seq)`,
	},
	{ // 6: the nodes of a store several servers share (PostgreSQL), each
		// with its lease and the epoch of its current membership.
		`CREATE TABLE nodes (
			name           TEXT NOT NULL PRIMARY KEY,
			addr           TEXT NOT NULL,
			epoch          BIGINT NOT NULL,
			started_ns     BIGINT NOT NULL,
			lease_until_ns BIGINT NOT NULL
		)`,
	},
	{ // 7: what belongs to which node: the journal's entries (each node
		// finishes or undoes its own operations), the checkpoint's
		// initiator, and each node's share of a checkpoint over several.
		`ALTER TABLE journal ADD COLUMN node TEXT NOT NULL DEFAULT ''`,
		`ALTER TABLE checkpoints ADD COLUMN node TEXT NOT NULL DEFAULT ''`,
		`CREATE TABLE checkpoint_shares (
			checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id),
			node          TEXT NOT NULL,
			epoch         BIGINT NOT NULL,
			state         TEXT NOT NULL,
			records       BIGINT NOT NULL,
			error         TEXT NOT NULL,
			PRIMARY KEY (checkpoint_id, node)
		)`,
	},
	{ // 8: restores over several nodes: the restore, and each node's share
		// (the episodes it brings back, and how far it is).
		`CREATE TABLE restores (
			id            TEXT NOT NULL PRIMARY KEY,
			checkpoint_id TEXT NOT NULL,
			node          TEXT NOT NULL,
			state         TEXT NOT NULL,
			error         TEXT NOT NULL,
			created_ns    BIGINT NOT NULL
		)`,
		`CREATE TABLE restore_shares (
			restore_id TEXT NOT NULL REFERENCES restores (id),
			node       TEXT NOT NULL,
			epoch      BIGINT NOT NULL,
			episodes   TEXT NOT NULL,
			state      TEXT NOT NULL,
			error      TEXT NOT NULL,
			PRIMARY KEY (restore_id, node)
		)`,
	},
}

// sqlStore is the Store over database/sql, for any dialect.
type sqlStore struct {
	db      *sql.DB
	d       dialect
	where   string // names the store in messages
	now     func() time.Time
	writeMu sync.Mutex
	// guard, when set, is the node whose live lease every write
	// transaction checks first (Postgres.AsNode).
	guard *Node
	// batch queues the small writes that share commits (batch.go).
	batch batcher
}

// q rewrites a query's placeholders for the dialect.
func (s *sqlStore) q(query string) string {
	if !s.d.dollarPlaceholders {
		return query
	}
	var b strings.Builder
	n := 0
	for _, c := range query {
		if c == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(c)
	}
	return b.String()
}

// node is the name of the node the store writes as ("" for a store of
// one server).
func (s *sqlStore) node() string {
	if s.guard == nil {
		return ""
	}
	return s.guard.Name
}

// maxTxAttempts bounds how often a write transaction runs when the engine
// keeps aborting it for conflicts with other writers.
const maxTxAttempts = 20

// tx runs fn in one transaction and commits it, or rolls it back if fn or the
// commit fails. A write transaction that the engine aborted for a conflict
// with another writer runs again (fn must set its results afresh each time
// it runs), up to maxTxAttempts times.
func (s *sqlStore) tx(ctx context.Context, readOnly bool, fn func(*sql.Tx) error) error {
	if !readOnly && s.d.serialWrites {
		s.writeMu.Lock()
		defer s.writeMu.Unlock()
	}
	for attempt := 1; ; attempt++ {
		err := s.txOnce(ctx, readOnly, fn)
		if err == nil || readOnly || s.d.retry == nil || !s.d.retry(err) || attempt >= maxTxAttempts {
			return err
		}
		// Back off a little, more each time, so that writers that keep
		// colliding spread out.
		select {
		case <-ctx.Done():
			return s.wrap(ctx.Err())
		case <-time.After(time.Duration(attempt*attempt) * time.Millisecond):
		}
	}
}

func (s *sqlStore) txOnce(ctx context.Context, readOnly bool, fn func(*sql.Tx) error) error {
	opts := &sql.TxOptions{ReadOnly: readOnly}
	if !readOnly {
		opts.Isolation = s.d.writeIsolation
	}
	tx, err := s.db.BeginTx(ctx, opts)
	if err != nil {
		return s.wrap(err)
	}
	if !readOnly {
		if err := s.checkGuard(ctx, tx); err != nil {
			_ = tx.Rollback()
			return err
		}
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return s.wrap(err)
	}
	return nil
}

// wrap names the store in an error from the database.
func (s *sqlStore) wrap(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("record store %s: %w", s.where, err)
}

// migrate brings the schema up to date, idempotently.
func (s *sqlStore) migrate(ctx context.Context) error {
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		if s.d.migrateLock != "" {
			if _, err := tx.ExecContext(ctx, s.d.migrateLock); err != nil {
				return s.wrap(err)
			}
		}
		if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)`); err != nil {
			return s.wrap(err)
		}
		var v int
		err := tx.QueryRowContext(ctx, `SELECT version FROM schema_version`).Scan(&v)
		if errors.Is(err, sql.ErrNoRows) {
			if _, err := tx.ExecContext(ctx, s.q(`INSERT INTO schema_version (version) VALUES (?)`), 0); err != nil {
				return s.wrap(err)
			}
		} else if err != nil {
			return s.wrap(err)
		}
		if v > len(migrations) {
			return fmt.Errorf("record store %s has schema version %d, newer than this stasis understands (up to %d): upgrade stasis", s.where, v, len(migrations))
		}
		for i := v; i < len(migrations); i++ {
			for _, stmt := range migrations[i] {
				if _, err := tx.ExecContext(ctx, stmt); err != nil {
					return fmt.Errorf("record store %s: schema version %d: %w", s.where, i+1, err)
				}
			}
		}
		if v < len(migrations) {
			if _, err := tx.ExecContext(ctx, s.q(`UPDATE schema_version SET version = ?`), len(migrations)); err != nil {
				return s.wrap(err)
			}
		}
		if s.d.journalSeq {
			return s.makeJournalSeq(ctx, tx)
		}
		return nil
	})
}

// makeJournalSeq makes the sequence of the journal's numbers if it is
// missing, starting above the journal's last entry (under the migration's
// lock: one process makes it).
func (s *sqlStore) makeJournalSeq(ctx context.Context, tx *sql.Tx) error {
	var missing bool
	if err := tx.QueryRowContext(ctx, `SELECT to_regclass('journal_seq') IS NULL`).Scan(&missing); err != nil {
		return s.wrap(err)
	}
	if !missing {
		return nil
	}
	if _, err := tx.ExecContext(ctx, `CREATE SEQUENCE journal_seq`); err != nil {
		return s.wrap(err)
	}
	_, err := tx.ExecContext(ctx, `SELECT setval('journal_seq', COALESCE(MAX(seq), 0) + 1, false) FROM journal`)
	return s.wrap(err)
}

// state reads a checkpoint's state inside tx, locking its row for a write.
func (s *sqlStore) state(ctx context.Context, tx *sql.Tx, id string) (State, error) {
	return s.lockState(ctx, tx, id, s.d.forUpdate)
}

// lockState reads a checkpoint's state inside tx, locking its row with
// lock (the dialect's forUpdate or forShare).
func (s *sqlStore) lockState(ctx context.Context, tx *sql.Tx, id, lock string) (State, error) {
	var st string
	err := tx.QueryRowContext(ctx, s.q(`SELECT state FROM checkpoints WHERE id = ?`+lock), id).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return "", notFound(id)
	}
	if err != nil {
		return "", s.wrap(err)
	}
	return State(st), nil
}

func notFound(id string) error {
	return fmt.Errorf("checkpoint %q: %w; list the checkpoints with: stasis ckpt ls", id, errdefs.ErrNotFound)
}

// Begin implements Store.
func (s *sqlStore) Begin(ctx context.Context, id string, manifest json.RawMessage) error {
	if err := checkID(id); err != nil {
		return err
	}
	if len(manifest) > 0 && !json.Valid(manifest) {
		return fmt.Errorf("begin checkpoint %q: its manifest is not valid JSON", id)
	}
	return s.tx(ctx, false, func(tx *sql.Tx) error { return s.beginTx(ctx, tx, id, manifest) })
}

// beginTx inserts pending checkpoint id inside tx.
func (s *sqlStore) beginTx(ctx context.Context, tx *sql.Tx, id string, manifest json.RawMessage) error {
	var n int
	if err := tx.QueryRowContext(ctx, s.q(`SELECT COUNT(*) FROM checkpoints WHERE id = ?`), id).Scan(&n); err != nil {
		return s.wrap(err)
	}
	if n > 0 {
		return fmt.Errorf("begin checkpoint %q: %w; choose a new id (ids are never reused, even after stasis ckpt rm)", id, errdefs.ErrExists)
	}
	// Creation times are strictly increasing, so that "newest first"
	// is the order checkpoints were begun in.
	var newest sql.NullInt64
	if err := tx.QueryRowContext(ctx, `SELECT MAX(created_ns) FROM checkpoints`).Scan(&newest); err != nil {
		return s.wrap(err)
	}
	created := s.now().UnixNano()
	if newest.Valid && created <= newest.Int64 {
		created = newest.Int64 + 1
	}
	_, err := tx.ExecContext(ctx, s.q(`INSERT INTO checkpoints (id, created_ns, state, manifest, error, committed_ns, node) VALUES (?, ?, ?, ?, ?, NULL, ?)`),
		id, created, string(StatePending), string(manifest), "", s.node())
	return s.wrap(err)
}

// Put implements Store.
func (s *sqlStore) Put(ctx context.Context, id string, rec Record) error {
	doc, err := rec.MarshalJSON()
	if err != nil {
		return fmt.Errorf("put into checkpoint %q: %w", id, err)
	}
	if rec, err = DecodeRecord(doc); err != nil {
		return fmt.Errorf("put into checkpoint %q: %w", id, err)
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		// Puts of one checkpoint's records run side by side (and share
		// the server's flushes to disk); Commit and Fail lock the
		// checkpoint's row for update, and so wait for those under way.
		st, err := s.lockState(ctx, tx, id, s.d.forShare)
		if err != nil {
			return err
		}
		if st != StatePending {
			return fmt.Errorf("put record of episode %q into checkpoint %q: %w: it is %s, and records go only into a pending checkpoint; begin a new checkpoint", rec.Episode, id, errdefs.ErrConflict, st)
		}
		// The usual case: the episode has no record there yet, and the
		// insert finds that out itself. Reading the records first would,
		// under PostgreSQL's serializable isolation, lock the index pages
		// read, into which the Puts beside this one insert: they would
		// keep aborting each other.
		res, err := tx.ExecContext(ctx, s.q(`INSERT INTO records (checkpoint_id, episode, provider, snapshot_id, doc) VALUES (?, ?, ?, ?, ?)
			ON CONFLICT (checkpoint_id, episode) DO NOTHING`),
			id, rec.Episode, rec.Provider, rec.SnapshotID, string(doc))
		if err != nil {
			return s.wrap(err)
		}
		inserted, err := res.RowsAffected()
		if err != nil {
			return s.wrap(err)
		}
		var old SnapshotRef
		replacing := inserted == 0
		if replacing {
			if err := tx.QueryRowContext(ctx, s.q(`SELECT provider, snapshot_id FROM records WHERE checkpoint_id = ? AND episode = ?`), id, rec.Episode).
				Scan(&old.Provider, &old.SnapshotID); err != nil {
				return s.wrap(err)
			}
			if _, err := tx.ExecContext(ctx, s.q(`UPDATE records SET provider = ?, snapshot_id = ?, doc = ? WHERE checkpoint_id = ? AND episode = ?`),
				rec.Provider, rec.SnapshotID, string(doc), id, rec.Episode); err != nil {
				return s.wrap(err)
			}
		}
		ref := SnapshotRef{rec.Provider, rec.SnapshotID}
		if ref.SnapshotID != "" {
			if _, err := tx.ExecContext(ctx, s.q(`INSERT INTO snapshot_refs (checkpoint_id, provider, snapshot_id) VALUES (?, ?, ?)
				ON CONFLICT (checkpoint_id, provider, snapshot_id) DO NOTHING`), id, ref.Provider, ref.SnapshotID); err != nil {
				return s.wrap(err)
			}
		}
		if replacing && old.SnapshotID != "" && old != ref {
			return s.dropRefIfUnused(ctx, tx, id, old)
		}
		return nil
	})
}

// dropRefIfUnused removes checkpoint id's reference to ref when none of its
// records names ref any more.
func (s *sqlStore) dropRefIfUnused(ctx context.Context, tx *sql.Tx, id string, ref SnapshotRef) error {
	var n int
	if err := tx.QueryRowContext(ctx, s.q(`SELECT COUNT(*) FROM records WHERE checkpoint_id = ? AND provider = ? AND snapshot_id = ?`),
		id, ref.Provider, ref.SnapshotID).Scan(&n); err != nil {
		return s.wrap(err)
	}
	if n > 0 {
		return nil
	}
	_, err := tx.ExecContext(ctx, s.q(`DELETE FROM snapshot_refs WHERE checkpoint_id = ? AND provider = ? AND snapshot_id = ?`), id, ref.Provider, ref.SnapshotID)
	return s.wrap(err)
}

// Commit implements Store. The check and the flip to committed are one
// transaction: a crash before it commits leaves the checkpoint pending, and
// no reader ever sees it committed with a record missing.
func (s *sqlStore) Commit(ctx context.Context, id string, expectEpisodes int) error {
	if expectEpisodes < 0 {
		return fmt.Errorf("commit checkpoint %q: %d expected episodes: the count cannot be negative", id, expectEpisodes)
	}
	var reason string
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		st, err := s.state(ctx, tx, id)
		if err != nil {
			return err
		}
		if st != StatePending {
			return fmt.Errorf("commit checkpoint %q: %w: it is %s, and only a pending checkpoint can be committed", id, errdefs.ErrConflict, st)
		}
		reason, err = s.commitLocked(ctx, tx, id, expectEpisodes)
		return err
	})
	if err != nil {
		return err
	}
	if reason != "" {
		return fmt.Errorf("commit checkpoint %q: %w: %s; it is marked failed and the previous committed checkpoint is unchanged", id, ErrIncomplete, reason)
	}
	return nil
}

// commitLocked commits pending checkpoint id, whose row tx holds, if
// exactly expect valid records are there; otherwise it marks it failed
// and returns why.
func (s *sqlStore) commitLocked(ctx context.Context, tx *sql.Tx, id string, expect int) (reason string, err error) {
	reason, err = s.checkRecords(ctx, tx, id, expect)
	if err != nil {
		return "", err
	}
	if reason != "" {
		_, err := tx.ExecContext(ctx, s.q(`UPDATE checkpoints SET state = ?, error = ? WHERE id = ?`), string(StateFailed), "commit refused: "+reason, id)
		return reason, s.wrap(err)
	}
	_, err = tx.ExecContext(ctx, s.q(`UPDATE checkpoints SET state = ?, committed_ns = ? WHERE id = ?`), string(StateCommitted), s.now().UnixNano(), id)
	return "", s.wrap(err)
}

// checkRecords returns why checkpoint id's records cannot be committed, or "".
func (s *sqlStore) checkRecords(ctx context.Context, tx *sql.Tx, id string, expect int) (string, error) {
	rows, err := tx.QueryContext(ctx, s.q(`SELECT episode, doc FROM records WHERE checkpoint_id = ? ORDER BY episode`), id)
	if err != nil {
		return "", s.wrap(err)
	}
	defer rows.Close()
	n := 0
	var bad []string
	for rows.Next() {
		var episode, doc string
		if err := rows.Scan(&episode, &doc); err != nil {
			return "", s.wrap(err)
		}
		n++
		rec, err := DecodeRecord([]byte(doc))
		switch {
		case err != nil:
			bad = append(bad, err.Error())
		case rec.Episode != episode:
			bad = append(bad, fmt.Sprintf("the record stored for episode %q names episode %q", episode, rec.Episode))
		}
	}
	if err := rows.Err(); err != nil {
		return "", s.wrap(err)
	}
	switch {
	case len(bad) > 0:
		return fmt.Sprintf("%d invalid records: %s", len(bad), strings.Join(bad, "; ")), nil
	case n != expect:
		return fmt.Sprintf("%d records are there, %d were expected", n, expect), nil
	}
	return "", nil
}

// Fail implements Store.
func (s *sqlStore) Fail(ctx context.Context, id, reason string) error {
	if reason == "" {
		reason = "marked failed"
	}
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		st, err := s.state(ctx, tx, id)
		if err != nil {
			return err
		}
		switch st {
		case StateFailed:
			return nil
		case StateCommitted:
			return fmt.Errorf("fail checkpoint %q: %w: it is committed, and a committed checkpoint is never changed; delete it with: stasis ckpt rm %s", id, errdefs.ErrConflict, id)
		}
		_, err = tx.ExecContext(ctx, s.q(`UPDATE checkpoints SET state = ?, error = ? WHERE id = ?`), string(StateFailed), reason, id)
		return s.wrap(err)
	})
}

const selectCheckpoint = `SELECT c.id, c.created_ns, c.state, c.manifest, c.error, c.committed_ns,
	(SELECT COUNT(*) FROM records r WHERE r.checkpoint_id = c.id) FROM checkpoints c`

type scanner interface{ Scan(dest ...any) error }

func scanCheckpoint(sc scanner) (Checkpoint, error) {
	var (
		c         Checkpoint
		created   int64
		state     string
		manifest  string
		committed sql.NullInt64
	)
	if err := sc.Scan(&c.ID, &created, &state, &manifest, &c.Error, &committed, &c.Episodes); err != nil {
		return Checkpoint{}, err
	}
	c.Created = time.Unix(0, created).UTC()
	c.State = State(state)
	if manifest != "" {
		c.Manifest = json.RawMessage(manifest)
	}
	if committed.Valid {
		t := time.Unix(0, committed.Int64).UTC()
		c.Committed = &t
	}
	return c, nil
}

// Get implements Store.
func (s *sqlStore) Get(ctx context.Context, id string) (Checkpoint, []Record, error) {
	var (
		c    Checkpoint
		recs []Record
	)
	err := s.tx(ctx, true, func(tx *sql.Tx) error {
		var err error
		c, err = scanCheckpoint(tx.QueryRowContext(ctx, s.q(selectCheckpoint+` WHERE c.id = ?`), id))
		if errors.Is(err, sql.ErrNoRows) {
			return notFound(id)
		}
		if err != nil {
			return s.wrap(err)
		}
		rows, err := tx.QueryContext(ctx, s.q(`SELECT doc FROM records WHERE checkpoint_id = ? ORDER BY episode`), id)
		if err != nil {
			return s.wrap(err)
		}
		defer rows.Close()
		for rows.Next() {
			var doc string
			if err := rows.Scan(&doc); err != nil {
				return s.wrap(err)
			}
			rec, err := DecodeRecord([]byte(doc))
			if err != nil {
				return fmt.Errorf("checkpoint %q: %w", id, err)
			}
			recs = append(recs, rec)
		}
		return s.wrap(rows.Err())
	})
	if err != nil {
		return Checkpoint{}, nil, err
	}
	return c, recs, nil
}

// List implements Store.
func (s *sqlStore) List(ctx context.Context, opts ListOptions) ([]Checkpoint, error) {
	switch opts.State {
	case "", StatePending, StateCommitted, StateFailed:
	default:
		return nil, fmt.Errorf("list checkpoints: state %q is unknown: use pending, committed or failed", opts.State)
	}
	if opts.Limit < 0 {
		return nil, fmt.Errorf("list checkpoints: limit %d is negative: use 0 for no limit", opts.Limit)
	}
	query, args := selectCheckpoint, []any{}
	if opts.State != "" {
		query += ` WHERE c.state = ?`
		args = append(args, string(opts.State))
	}
	query += ` ORDER BY c.created_ns DESC, c.id DESC`
	if opts.Limit > 0 {
		query += ` LIMIT ?`
		args = append(args, opts.Limit)
	}
	var out []Checkpoint
	err := s.tx(ctx, true, func(tx *sql.Tx) error {
		rows, err := tx.QueryContext(ctx, s.q(query), args...)
		if err != nil {
			return s.wrap(err)
		}
		defer rows.Close()
		for rows.Next() {
			c, err := scanCheckpoint(rows)
			if err != nil {
				return s.wrap(err)
			}
			out = append(out, c)
		}
		return s.wrap(rows.Err())
	})
	return out, err
}

// Latest implements Store.
func (s *sqlStore) Latest(ctx context.Context) (Checkpoint, error) {
	cs, err := s.List(ctx, ListOptions{State: StateCommitted, Limit: 1})
	if err != nil {
		return Checkpoint{}, err
	}
	if len(cs) == 0 {
		return Checkpoint{}, fmt.Errorf("latest checkpoint: %w: no checkpoint has been committed in %s", errdefs.ErrNotFound, s.where)
	}
	return cs[0], nil
}

// Delete implements Store.
func (s *sqlStore) Delete(ctx context.Context, id string) ([]SnapshotRef, error) {
	var freed []SnapshotRef
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		freed = nil
		st, err := s.state(ctx, tx, id)
		if err != nil {
			return err
		}
		if st == StatePending {
			return fmt.Errorf("delete checkpoint %q: %w: it is pending, so a save may still be writing it; once no save is running, mark it failed (stasis ckpt rm --force) and delete it", id, errdefs.ErrConflict)
		}
		rows, err := tx.QueryContext(ctx, s.q(`SELECT provider, snapshot_id FROM snapshot_refs WHERE checkpoint_id = ?`), id)
		if err != nil {
			return s.wrap(err)
		}
		var refs []SnapshotRef
		for rows.Next() {
			var r SnapshotRef
			if err := rows.Scan(&r.Provider, &r.SnapshotID); err != nil {
				rows.Close()
				return s.wrap(err)
			}
			refs = append(refs, r)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return s.wrap(err)
		}
		for _, stmt := range []string{
			`DELETE FROM snapshot_refs WHERE checkpoint_id = ?`,
			`DELETE FROM records WHERE checkpoint_id = ?`,
			`DELETE FROM checkpoint_shares WHERE checkpoint_id = ?`,
			`DELETE FROM checkpoints WHERE id = ?`,
		} {
			if _, err := tx.ExecContext(ctx, s.q(stmt), id); err != nil {
				return s.wrap(err)
			}
		}
		for _, r := range refs {
			var n int
			if err := tx.QueryRowContext(ctx, s.q(`SELECT COUNT(*) FROM snapshot_refs WHERE provider = ? AND snapshot_id = ?`), r.Provider, r.SnapshotID).Scan(&n); err != nil {
				return s.wrap(err)
			}
			if n == 0 {
				freed = append(freed, r)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(freed, func(i, j int) bool {
		if freed[i].Provider != freed[j].Provider {
			return freed[i].Provider < freed[j].Provider
		}
		return freed[i].SnapshotID < freed[j].SnapshotID
	})
	return freed, nil
}

// RecoverPending implements Store.
func (s *sqlStore) RecoverPending(ctx context.Context, olderThan time.Duration) ([]string, error) {
	if olderThan < 0 {
		return nil, fmt.Errorf("recover pending checkpoints: age %v is negative", olderThan)
	}
	now := s.now()
	cutoff := now.Add(-olderThan).UnixNano()
	var failed []string
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		failed = nil
		rows, err := tx.QueryContext(ctx, s.q(`SELECT id, created_ns FROM checkpoints WHERE state = ? AND created_ns <= ? AND node = ? ORDER BY created_ns`), string(StatePending), cutoff, s.node())
		if err != nil {
			return s.wrap(err)
		}
		type pending struct {
			id      string
			created int64
		}
		var ps []pending
		for rows.Next() {
			var p pending
			if err := rows.Scan(&p.id, &p.created); err != nil {
				rows.Close()
				return s.wrap(err)
			}
			ps = append(ps, p)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return s.wrap(err)
		}
		for _, p := range ps {
			age := now.Sub(time.Unix(0, p.created)).Round(time.Millisecond)
			reason := fmt.Sprintf("interrupted save: still pending %v after it began; the previous committed checkpoint is unchanged", age)
			if _, err := tx.ExecContext(ctx, s.q(`UPDATE checkpoints SET state = ?, error = ? WHERE id = ? AND state = ?`),
				string(StateFailed), reason, p.id, string(StatePending)); err != nil {
				return s.wrap(err)
			}
			failed = append(failed, p.id)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return failed, nil
}

// PutVerdict implements Store.
func (s *sqlStore) PutVerdict(ctx context.Context, episode string, attempt int, doc json.RawMessage) (json.RawMessage, bool, error) {
	if episode == "" {
		return nil, false, errors.New("verdict: the episode id is empty")
	}
	if attempt < 0 {
		return nil, false, fmt.Errorf("verdict of episode %q: attempt %d is negative", episode, attempt)
	}
	if !json.Valid(doc) {
		return nil, false, fmt.Errorf("verdict of episode %q: not valid JSON", episode)
	}
	var (
		stored  json.RawMessage
		created bool
	)
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		stored, created = nil, false
		var have string
		err := tx.QueryRowContext(ctx, s.q(`SELECT doc FROM verdicts WHERE episode = ? AND attempt = ?`+s.d.forUpdate), episode, attempt).Scan(&have)
		switch {
		case err == nil:
			stored = json.RawMessage(have)
			return nil
		case !errors.Is(err, sql.ErrNoRows):
			return s.wrap(err)
		}
		if _, err := tx.ExecContext(ctx, s.q(`INSERT INTO verdicts (episode, attempt, created_ns, doc) VALUES (?, ?, ?, ?)`),
			episode, attempt, s.now().UnixNano(), string(doc)); err != nil {
			return s.wrap(err)
		}
		stored, created = append(json.RawMessage(nil), doc...), true
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return stored, created, nil
}

// GetVerdict implements Store.
func (s *sqlStore) GetVerdict(ctx context.Context, episode string, attempt int) (json.RawMessage, error) {
	var doc string
	err := s.db.QueryRowContext(ctx, s.q(`SELECT doc FROM verdicts WHERE episode = ? AND attempt = ?`), episode, attempt).Scan(&doc)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("verdict of episode %q, attempt %d: %w", episode, attempt, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, s.wrap(err)
	}
	return json.RawMessage(doc), nil
}

// Close implements Store.
func (s *sqlStore) Close() error { return s.wrap(s.db.Close()) }
