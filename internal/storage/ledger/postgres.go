package ledger

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"stasis/internal/storage/dburl"
)

// Postgres is the Storage of ledgers in a PostgreSQL database, which the
// gateways of many nodes share. A ledger is the rows of ledger_chunks, each
// the bytes of one write (whole records, exactly as a ledger file would hold
// them) at its offset, and its row in ledger_heads: its length and its
// fence, the highest attempt of the episode that has fenced it.
//
// An append is one statement that moves the head from the length the
// writer knows to the new one and inserts the chunk, only if the head is
// still at that length and the fence is not above the writer's attempt: a
// gateway that lost the episode (a newer attempt fenced it, or another
// gateway appended since it read) changes nothing and gets ErrFenced.
// Appends of many episodes that arrive together share one round trip and
// one commit (group commit): they are sent as one batch, which PostgreSQL
// runs as one transaction, and each returns once that transaction is
// committed (durable as the server's synchronous_commit makes it; its
// default waits for the WAL to be flushed).
type Postgres struct {
	pool  *pgxpool.Pool
	where string
	// node and epoch, when node is set, are the member of the store's
	// nodes whose live lease every write needs (AsNode).
	node  string
	epoch int64

	mu      sync.Mutex
	queue   []*pgAppend
	leading bool

	commits, appends atomic.Uint64
}

var _ Storage = (*Postgres)(nil)

// pgAppend is one append waiting for its batch.
type pgAppend struct {
	episode string
	at      int64
	lines   []byte
	fence   int
	done    chan struct{}
	applied bool
	err     error
}

// maxBatch bounds the appends one commit carries.
const maxBatch = 512

// ledgerSchema makes the ledger tables; every statement is idempotent.
var ledgerSchema = []string{
	`CREATE TABLE IF NOT EXISTS ledger_heads (
		episode TEXT NOT NULL PRIMARY KEY,
		bytes   BIGINT NOT NULL,
		fence   INTEGER NOT NULL
	)`,
	`CREATE TABLE IF NOT EXISTS ledger_chunks (
		episode TEXT NOT NULL,
		off     BIGINT NOT NULL,
		data    BYTEA NOT NULL,
		PRIMARY KEY (episode, off)
	)`,
}

// ledgerSchemaLock makes concurrent schema setups take turns.
const ledgerSchemaLock = 0x5354_4c45_4447 // "STLEDG"

// OpenPostgres opens the ledger storage in the PostgreSQL database at dsn
// (a postgres:// URL), making its tables when missing.
func OpenPostgres(ctx context.Context, dsn string) (*Postgres, error) {
	where := dburl.Redact(dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("ledger storage %s: %w", where, err)
	}
	if cfg.MaxConns < 8 {
		cfg.MaxConns = 8
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("ledger storage %s: %w", where, err)
	}
	p := &Postgres{pool: pool, where: where}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := pgx.BeginFunc(sctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(sctx, `SELECT pg_advisory_xact_lock($1)`, int64(ledgerSchemaLock)); err != nil {
			return err
		}
		for _, stmt := range ledgerSchema {
			if _, err := tx.Exec(sctx, stmt); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ledger storage %s: %w; check that the server runs and the URL's host, port, user, database and password", where, err)
	}
	return p, nil
}

// Close closes the connections (of every view AsNode made too).
func (p *Postgres) Close() { p.pool.Close() }

// AsNode is the storage as the node name, in its epoch, writes it: every
// append and fence also needs that node's lease in the store's nodes
// table (store.Postgres.Join) to be live, judged by the database's clock,
// in the same statement; otherwise it changes nothing and fails with
// ErrFenced. A node cut off from the others past its lease can then no
// longer write any ledger. The view shares p's connections.
func (p *Postgres) AsNode(name string, epoch int64) *Postgres {
	return &Postgres{pool: p.pool, where: p.where, node: name, epoch: epoch}
}

// liveLease is the condition that the node named by parameter $name, in
// the epoch of parameter $epoch, holds a live lease by the database's
// clock (the store's nodes table).
func liveLease(name, epoch int) string {
	return fmt.Sprintf(`EXISTS (SELECT 1 FROM nodes WHERE name = $%d AND epoch = $%d AND lease_until_ns > CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000 AS BIGINT))`, name, epoch)
}

// Commits returns how many commits the appends took, and how many appends
// they carried.
func (p *Postgres) Commits() (commits, appends uint64) { return p.commits.Load(), p.appends.Load() }

// Where implements Storage.
func (p *Postgres) Where(episode string) string {
	return fmt.Sprintf("%s (ledger of episode %s)", p.where, episode)
}

// OpenLog implements Storage.
func (p *Postgres) OpenLog(episode string) (Log, []byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.pool.Exec(ctx, `INSERT INTO ledger_heads (episode, bytes, fence) VALUES ($1, 0, 0) ON CONFLICT (episode) DO NOTHING`, episode); err != nil {
		return nil, nil, fmt.Errorf("open ledger %s: %w", p.Where(episode), err)
	}
	data, err := p.read(ctx, episode)
	if err != nil {
		return nil, nil, err
	}
	return &pgLog{p: p, episode: episode}, data, nil
}

// ReadAll implements Storage.
func (p *Postgres) ReadAll(episode string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return p.read(ctx, episode)
}

// Size implements sizer: the ledger's length, from its head row alone.
func (p *Postgres) Size(episode string) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var length int64
	err := p.pool.QueryRow(ctx, `SELECT bytes FROM ledger_heads WHERE episode = $1`, episode).Scan(&length)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("ledger of episode %s: %w", episode, fs.ErrNotExist)
	}
	return length, err
}

// read reads a ledger's head and chunks in one snapshot, and checks that
// they agree.
func (p *Postgres) read(ctx context.Context, episode string) ([]byte, error) {
	var data []byte
	err := pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		data = nil
		var length int64
		err := tx.QueryRow(ctx, `SELECT bytes FROM ledger_heads WHERE episode = $1`, episode).Scan(&length)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("ledger of episode %s: %w", episode, fs.ErrNotExist)
		}
		if err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `SELECT off, data FROM ledger_chunks WHERE episode = $1 AND off < $2 ORDER BY off`, episode, length)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				off   int64
				chunk []byte
			)
			if err := rows.Scan(&off, &chunk); err != nil {
				return err
			}
			if off != int64(len(data)) {
				return fmt.Errorf("%w: a chunk at byte %d, but the chunks before it end at %d", ErrCorrupt, off, len(data))
			}
			data = append(data, chunk...)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if int64(len(data)) != length {
			return fmt.Errorf("%w: its chunks hold %d bytes, its head says %d", ErrCorrupt, len(data), length)
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		return nil, fmt.Errorf("read ledger %s: %w", p.Where(episode), err)
	}
	return data, nil
}

// Remove implements Storage.
func (p *Postgres) Remove(episode string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM ledger_chunks WHERE episode = $1`, episode); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `DELETE FROM ledger_heads WHERE episode = $1`, episode)
		return err
	})
	if err != nil {
		return fmt.Errorf("remove ledger %s: %w", p.Where(episode), err)
	}
	return nil
}

// appendSQL moves an episode's head from $2 to $2 plus the chunk's length,
// if it is still at $2 and fenced no higher than $4, and stores the chunk;
// it returns a row only when it did.
const appendSQL = `WITH head AS (
	UPDATE ledger_heads SET bytes = $2 + octet_length($3::bytea), fence = GREATEST(fence, $4)
	WHERE episode = $1 AND bytes = $2 AND fence <= $4
	RETURNING episode)
INSERT INTO ledger_chunks (episode, off, data) SELECT episode, $2, $3 FROM head RETURNING off`

// appendAsNodeSQL is appendSQL that also needs the node's lease.
var appendAsNodeSQL = fmt.Sprintf(`WITH head AS (
	UPDATE ledger_heads SET bytes = $2 + octet_length($3::bytea), fence = GREATEST(fence, $4)
	WHERE episode = $1 AND bytes = $2 AND fence <= $4 AND %s
	RETURNING episode)
INSERT INTO ledger_chunks (episode, off, data) SELECT episode, $2, $3 FROM head RETURNING off`, liveLease(5, 6))

// submit queues an append for the next batch and waits for its commit. The
// first append to arrive while no batch is being committed starts a
// leader, which commits what is queued, batch after batch, until the queue
// is empty.
func (p *Postgres) submit(a *pgAppend) {
	a.done = make(chan struct{})
	p.mu.Lock()
	p.queue = append(p.queue, a)
	if !p.leading {
		p.leading = true
		go p.lead()
	}
	p.mu.Unlock()
	<-a.done
}

func (p *Postgres) lead() {
	for {
		p.mu.Lock()
		if len(p.queue) == 0 {
			p.leading = false
			p.mu.Unlock()
			return
		}
		n := min(len(p.queue), maxBatch)
		batch := p.queue[:n:n]
		p.queue = p.queue[n:]
		p.mu.Unlock()
		p.commit(batch)
	}
}

// commit sends a batch of appends as one implicit transaction.
func (p *Postgres) commit(batch []*pgAppend) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := &pgx.Batch{}
	for _, a := range batch {
		if p.node != "" {
			b.Queue(appendAsNodeSQL, a.episode, a.at, a.lines, a.fence, p.node, p.epoch)
		} else {
			b.Queue(appendSQL, a.episode, a.at, a.lines, a.fence)
		}
	}
	err := func() error {
		br := p.pool.SendBatch(ctx, b)
		for _, a := range batch {
			var off int64
			err := br.QueryRow().Scan(&off)
			switch {
			case err == nil:
				a.applied = true
			case errors.Is(err, pgx.ErrNoRows):
			default:
				br.Close()
				return err
			}
		}
		return br.Close() // the commit
	}()
	p.commits.Add(1)
	p.appends.Add(uint64(len(batch)))
	for _, a := range batch {
		switch {
		case err != nil:
			// Whether the batch committed is not known.
			a.err = fmt.Errorf("ledger %s: %w: %w", p.Where(a.episode), ErrUnflushed, err)
		case !a.applied:
			a.err = p.refused(ctx, a)
		}
		close(a.done)
	}
}

// refused says why an append changed nothing.
func (p *Postgres) refused(ctx context.Context, a *pgAppend) error {
	if err := p.checkNode(ctx); err != nil {
		return fmt.Errorf("ledger %s: %w", p.Where(a.episode), err)
	}
	var length int64
	var fence int
	err := p.pool.QueryRow(ctx, `SELECT bytes, fence FROM ledger_heads WHERE episode = $1`, a.episode).Scan(&length, &fence)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("ledger %s: %w: it was removed", p.Where(a.episode), ErrFenced)
	case err != nil:
		return fmt.Errorf("ledger %s: %w: %w", p.Where(a.episode), ErrFenced, err)
	case fence > a.fence:
		return fmt.Errorf("ledger %s: %w: attempt %d writes, but attempt %d has taken the episode", p.Where(a.episode), ErrFenced, a.fence, fence)
	default:
		return fmt.Errorf("ledger %s: %w: another gateway has written to it since this one read it (it holds %d bytes, this one knew %d): reopen it", p.Where(a.episode), ErrFenced, length, a.at)
	}
}

// checkNode fails with ErrFenced when the storage writes as a node whose
// lease is not live.
func (p *Postgres) checkNode(ctx context.Context) error {
	if p.node == "" {
		return nil
	}
	var live bool
	err := p.pool.QueryRow(ctx, `SELECT `+liveLease(1, 2), p.node, p.epoch).Scan(&live)
	if err != nil {
		return err
	}
	if !live {
		return fmt.Errorf("%w: node %s (epoch %d) no longer holds a live lease, so it writes no ledger; it must stop touching its episodes", ErrFenced, p.node, p.epoch)
	}
	return nil
}

// pgLog is one episode's ledger in a Postgres storage.
type pgLog struct {
	p       *Postgres
	episode string
}

func (l *pgLog) Append(at int64, lines []byte, fence int) error {
	a := &pgAppend{episode: l.episode, at: at, lines: lines, fence: fence}
	l.p.submit(a)
	return a.err
}

func (l *pgLog) Fence(attempt int) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var fence int
	q, args := `UPDATE ledger_heads SET fence = $2 WHERE episode = $1 AND fence <= $2 RETURNING fence`, []any{l.episode, attempt}
	if l.p.node != "" {
		q = `UPDATE ledger_heads SET fence = $2 WHERE episode = $1 AND fence <= $2 AND ` + liveLease(3, 4) + ` RETURNING fence`
		args = append(args, l.p.node, l.p.epoch)
	}
	err := l.p.pool.QueryRow(ctx, q, args...).Scan(&fence)
	if errors.Is(err, pgx.ErrNoRows) {
		if err := l.p.checkNode(ctx); err != nil {
			return fmt.Errorf("ledger %s: %w", l.p.Where(l.episode), err)
		}
		err = l.p.pool.QueryRow(ctx, `SELECT fence FROM ledger_heads WHERE episode = $1`, l.episode).Scan(&fence)
		if err == nil {
			return fmt.Errorf("ledger %s: %w: attempt %d has taken the episode, not %d", l.p.Where(l.episode), ErrFenced, fence, attempt)
		}
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("ledger %s: %w: it was removed", l.p.Where(l.episode), ErrFenced)
		}
	}
	if err != nil {
		return fmt.Errorf("fence ledger %s: %w", l.p.Where(l.episode), err)
	}
	return nil
}

func (l *pgLog) Close() error { return nil }
