package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"stasis/internal/storage/dburl"
)

// Postgres is the record store in a PostgreSQL database, for several
// servers on several machines sharing one state: the same schema and SQL as
// SQLite (sql.go), with write transactions at serializable isolation,
// retried when PostgreSQL aborts one for a conflict with another writer.
// A commit returns once PostgreSQL has made it durable (the server's
// synchronous_commit decides how; its default is to the WAL on disk).
type Postgres struct {
	sqlStore
	// leases is a connection of the nodes' leases' own (Renew, Leave),
	// shared by a node's view of the store (AsNode).
	leases *sql.DB
}

var _ Store = (*Postgres)(nil)

var postgresDialect = dialect{
	name:               "postgres",
	dollarPlaceholders: true,
	forUpdate:          " FOR UPDATE",
	forShare:           " FOR SHARE",
	writeIsolation:     sql.LevelSerializable,
	retry:              retryablePostgres,
	migrateLock:        fmt.Sprintf(`SELECT pg_advisory_xact_lock(%d)`, migrationLock),
	journalSeq:         true,
}

// OpenPostgres opens the record store in the PostgreSQL database at dsn (a
// postgres:// URL), creating its schema if missing and migrating an older
// one; doing so twice, or from several processes at once, changes nothing.
func OpenPostgres(ctx context.Context, dsn string) (*Postgres, error) {
	where := dburl.Redact(dsn)
	if !dburl.IsPostgres(dsn) {
		return nil, fmt.Errorf("record store %s: not a PostgreSQL URL: write postgres://USER@HOST:PORT/DATABASE (or ?host=/socket/dir for a unix socket)", where)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("record store %s: %w", where, err)
	}
	sizePool(db)
	leases, err := sql.Open("pgx", dsn)
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("record store %s: %w", where, err)
	}
	leases.SetMaxOpenConns(1)
	s := &Postgres{sqlStore: sqlStore{db: db, d: postgresDialect, where: where, now: time.Now}, leases: leases}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		_ = leases.Close()
		return nil, fmt.Errorf("record store %s: cannot connect: %w; check that the server runs, the URL's host, port, user and database, and its password (in the URL or PGPASSWORD)", where, err)
	}
	if err := s.migrate(ctx); err != nil {
		_ = db.Close()
		_ = leases.Close()
		return nil, err
	}
	return s, nil
}

// Close closes the store's connections.
func (s *Postgres) Close() error {
	err := s.sqlStore.Close()
	if s.leases != nil {
		err = errors.Join(err, s.wrap(s.leases.Close()))
	}
	return err
}

// sizePool sets the limits of a store's pool of connections.
func sizePool(db *sql.DB) {
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	db.SetConnMaxIdleTime(5 * time.Minute)
}

// DB is the database handle, for the parts of stasis that keep their own
// tables beside the store's (the ledger, the nodes).
func (s *Postgres) DB() *sql.DB { return s.db }

// retryablePostgres reports whether PostgreSQL aborted a transaction for a
// conflict that a retry resolves: a serialization failure or a deadlock.
func retryablePostgres(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == "40001" || pe.Code == "40P01"
	}
	return false
}

// migrationLock is the advisory lock that makes concurrent migrations of
// one database take turns.
const migrationLock = 0x5741_5349_5300 // "STASIS"
