package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"time"

	"stasis/errdefs"
)

// Node is one server (stasis serve --node NAME) of several sharing a
// PostgreSQL store. It holds a lease that it renews (its heartbeat) and
// that is judged by the database's clock, so the servers' clocks do not
// matter. Each Join of a name starts a new epoch: a server that lost its
// lease and comes back, or another process under the same name, is a new
// member, and whatever the old epoch still tries is refused.
type Node struct {
	Name  string `json:"name"`
	Addr  string `json:"addr,omitempty"` // its API, as other nodes and trainers reach it
	Epoch int64  `json:"epoch"`
	// Started is when this epoch joined; LeaseUntil is when its lease
	// runs out unless renewed.
	Started    time.Time `json:"started"`
	LeaseUntil time.Time `json:"lease_until"`
	// Live: the lease had not run out when the store was asked.
	Live bool `json:"live"`
}

// ErrLeaseLost: the node's lease ran out (or a newer epoch of its name
// joined): it may no longer write anything to the store, its ledgers
// included, and must stop touching its episodes.
var ErrLeaseLost = errdefs.Errorf(errdefs.ErrConflict, "the node's lease has run out")

var nodeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// CheckNodeName refuses a node name that is not 1 to 63 letters, digits,
// '.', '_' or '-', starting with a letter or digit.
func CheckNodeName(name string) error {
	if !nodeName.MatchString(name) {
		return errdefs.Errorf(errdefs.ErrInvalid, "node name %q: use 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	return nil
}

// dbNowNS is the database's clock, in unix nanoseconds.
const dbNowNS = `CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000 AS BIGINT)`

// txNowNS is when the transaction began by the database's clock, in unix
// nanoseconds: no later than its snapshot, so a lease the snapshot shows
// ending before it had ended when the snapshot was taken (and, once
// ended, an epoch's lease is never renewed).
const txNowNS = `CAST(EXTRACT(EPOCH FROM transaction_timestamp()) * 1000000000 AS BIGINT)`

// Join registers node name (at addr) with a lease of lease from now, as a
// new epoch of that name. A name whose lease is still live is refused
// (another server runs under it).
func (s *Postgres) Join(ctx context.Context, name, addr string, lease time.Duration) (Node, error) {
	if err := CheckNodeName(name); err != nil {
		return Node{}, err
	}
	if lease < time.Second {
		return Node{}, errdefs.Errorf(errdefs.ErrInvalid, "node lease %v: give at least 1s", lease)
	}
	var n Node
	err := s.tx(ctx, false, func(tx *sql.Tx) error {
		var live bool
		var until int64
		err := tx.QueryRowContext(ctx, `SELECT lease_until_ns > `+dbNowNS+`, lease_until_ns FROM nodes WHERE name = $1 FOR UPDATE`, name).Scan(&live, &until)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			_, err = tx.ExecContext(ctx, `INSERT INTO nodes (name, addr, epoch, started_ns, lease_until_ns) VALUES ($1, $2, 1, `+dbNowNS+`, `+dbNowNS+` + $3)`, name, addr, lease.Nanoseconds())
			if err != nil {
				return s.wrap(err)
			}
		case err != nil:
			return s.wrap(err)
		case live:
			return errdefs.Errorf(errdefs.ErrConflict, "node %q is live: its lease runs until %s, so another stasis serve runs under that name; give this one another --node, or stop that one", name, time.Unix(0, until).UTC().Format(time.RFC3339Nano))
		default:
			_, err = tx.ExecContext(ctx, `UPDATE nodes SET addr = $2, epoch = epoch + 1, started_ns = `+dbNowNS+`, lease_until_ns = `+dbNowNS+` + $3 WHERE name = $1`, name, addr, lease.Nanoseconds())
			if err != nil {
				return s.wrap(err)
			}
		}
		n, err = scanNode(tx.QueryRowContext(ctx, selectNode+` WHERE name = $1`, name))
		return s.wrap(err)
	})
	return n, err
}

// Renew extends node n's lease to lease from now, if its epoch still
// holds it; otherwise ErrLeaseLost. It is one statement on a connection
// of its own (not the pool the node's writes queue for), outside any
// serializable transaction, and it does not wait for the node's writes:
// they hold the node's row only FOR KEY SHARE (checkGuard), which a
// renewal's update of the lease does not conflict with. A busy node's
// heartbeat so gets through while its writes run.
//
// Nor does it wait for the disk: a renewal is committed without waiting
// for its WAL to be flushed (synchronous_commit off for it alone). A
// renewal lost in a crash of the database only ends the lease sooner,
// and a loaded disk's flushes (seconds, under other writers) no longer
// eat into the lease.
func (s *Postgres) Renew(ctx context.Context, n Node, lease time.Duration) (Node, error) {
	tx, err := s.leaseDB().BeginTx(ctx, nil)
	if err != nil {
		return Node{}, s.wrap(err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit, a no-op
	if _, err := tx.ExecContext(ctx, `SET LOCAL synchronous_commit TO OFF`); err != nil {
		return Node{}, s.wrap(err)
	}
	out, err := scanNode(tx.QueryRowContext(ctx, `UPDATE nodes SET lease_until_ns = `+dbNowNS+` + $3
		WHERE name = $1 AND epoch = $2 AND lease_until_ns > `+dbNowNS+`
		RETURNING name, addr, epoch, started_ns, lease_until_ns, lease_until_ns > `+dbNowNS, n.Name, n.Epoch, lease.Nanoseconds()))
	if errors.Is(err, sql.ErrNoRows) {
		return Node{}, fmt.Errorf("node %s (epoch %d): %w", n.Name, n.Epoch, ErrLeaseLost)
	}
	if err != nil {
		return Node{}, s.wrap(err)
	}
	return out, s.wrap(tx.Commit())
}

// leaseDB is the connection renewals and leaves go through: the lease's
// own, or the pool when there is none.
func (s *Postgres) leaseDB() *sql.DB {
	if s.leases != nil {
		return s.leases
	}
	return s.db
}

// Leave ends node n's lease now (a server stopping cleanly), if its epoch
// still holds it.
func (s *Postgres) Leave(ctx context.Context, n Node) error {
	_, err := s.leaseDB().ExecContext(ctx, `UPDATE nodes SET lease_until_ns = `+dbNowNS+` WHERE name = $1 AND epoch = $2`, n.Name, n.Epoch)
	return s.wrap(err)
}

// Nodes lists every node that ever joined, live or not, by name.
func (s *Postgres) Nodes(ctx context.Context) ([]Node, error) {
	rows, err := s.db.QueryContext(ctx, selectNode+` ORDER BY name`)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []Node
	for rows.Next() {
		n, err := scanNode(rows)
		if err != nil {
			return nil, s.wrap(err)
		}
		out = append(out, n)
	}
	return out, s.wrap(rows.Err())
}

const selectNode = `SELECT name, addr, epoch, started_ns, lease_until_ns, lease_until_ns > ` + dbNowNS + ` FROM nodes`

func scanNode(sc scanner) (Node, error) {
	var n Node
	var started, until int64
	if err := sc.Scan(&n.Name, &n.Addr, &n.Epoch, &started, &until, &n.Live); err != nil {
		return Node{}, err
	}
	n.Started, n.LeaseUntil = time.Unix(0, started).UTC(), time.Unix(0, until).UTC()
	return n, nil
}

// AsNode is the store as node n writes it: every write transaction first
// checks, in the same transaction, that n's epoch still holds a live
// lease, and changes nothing otherwise (ErrLeaseLost). A node whose lease
// ran out while it still runs (cut off from the database, say) can then
// neither put records nor commit a checkpoint nor change an episode.
func (s *Postgres) AsNode(n Node) *Postgres {
	return &Postgres{sqlStore: sqlStore{db: s.db, d: s.d, where: s.where, now: s.now, guard: &n}, leases: s.leases}
}

// checkGuard refuses a write of a store whose node has lost its lease.
func (s *sqlStore) checkGuard(ctx context.Context, tx *sql.Tx) error {
	if s.guard == nil {
		return nil
	}
	var ok int
	// FOR KEY SHARE: a Join of a new epoch (SELECT … FOR UPDATE) waits
	// for this write to end, and so can never see it commit after; the
	// node's own renewals (an update of the lease alone) do not wait.
	err := tx.QueryRowContext(ctx, `SELECT 1 FROM nodes WHERE name = $1 AND epoch = $2 AND lease_until_ns > `+dbNowNS+` FOR KEY SHARE`, s.guard.Name, s.guard.Epoch).Scan(&ok)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("record store %s: node %s (epoch %d): %w; nothing was written", s.where, s.guard.Name, s.guard.Epoch, ErrLeaseLost)
	}
	return s.wrap(err)
}
