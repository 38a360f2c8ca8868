package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// JournalEntry is one step of an operation under way (a checkpoint's
// prepare, a restore), written before the step creates anything: a
// snapshot, a fork, a gateway attempt. A server that dies in the middle of
// an operation leaves its entries; the next one reads them (Journal) and
// finishes or undoes the operation, then closes it (CloseJournal). What
// the entries mean is their writer's business: the store keeps them in
// order and nothing else.
type JournalEntry struct {
	// Op names the operation; every entry of one operation has the same.
	Op string `json:"op"`
	// Seq orders every entry of the journal: AppendJournal assigns it.
	Seq     int64  `json:"seq"`
	Kind    string `json:"kind"`
	Episode string `json:"episode,omitempty"`
	// Doc is the step's details, a JSON document (empty: none).
	Doc     json.RawMessage `json:"doc,omitempty"`
	Created time.Time       `json:"created"`
}

// maxSeqSkips bounds the journal numbers an append skips because they
// are taken.
const maxSeqSkips = 1000

// AppendJournal implements Store.
func (s *sqlStore) AppendJournal(ctx context.Context, e JournalEntry) (JournalEntry, error) {
	if e.Op == "" || e.Kind == "" {
		return e, errors.New("journal: an entry needs an operation and a kind")
	}
	doc := string(e.Doc)
	if doc != "" && !json.Valid(e.Doc) {
		return e, fmt.Errorf("journal of %s: the %s entry's document is not valid JSON", e.Op, e.Kind)
	}
	e.Created = s.now().UTC()
	err := s.write(ctx, func(tx *sql.Tx) error {
		if s.d.journalSeq {
			// A node of an older stasis, on the same store, numbers its
			// entries MAX(seq) + 1 and may have taken the sequence's next
			// numbers: those are skipped.
			for range maxSeqSkips {
				err := tx.QueryRowContext(ctx, s.q(`INSERT INTO journal (seq, op, kind, episode, doc, created_ns, node) VALUES (nextval('journal_seq'), ?, ?, ?, ?, ?, ?)
					ON CONFLICT (seq) DO NOTHING RETURNING seq`),
					e.Op, e.Kind, e.Episode, doc, e.Created.UnixNano(), s.node()).Scan(&e.Seq)
				if !errors.Is(err, sql.ErrNoRows) {
					return s.wrap(err)
				}
			}
			return fmt.Errorf("journal of %s: %d numbers of the journal's sequence in a row were taken already: is a node of an older stasis numbering entries on this store? upgrade every node", e.Op, maxSeqSkips)
		}
		var last sql.NullInt64
		if err := tx.QueryRowContext(ctx, `SELECT MAX(seq) FROM journal`).Scan(&last); err != nil {
			return s.wrap(err)
		}
		e.Seq = last.Int64 + 1
		_, err := tx.ExecContext(ctx, s.q(`INSERT INTO journal (seq, op, kind, episode, doc, created_ns, node) VALUES (?, ?, ?, ?, ?, ?, ?)`),
			e.Seq, e.Op, e.Kind, e.Episode, doc, e.Created.UnixNano(), s.node())
		return s.wrap(err)
	})
	if err != nil {
		return e, err
	}
	return e, nil
}

// Journal implements Store.
func (s *sqlStore) Journal(ctx context.Context) ([]JournalEntry, error) {
	var out []JournalEntry
	err := s.tx(ctx, true, func(tx *sql.Tx) error {
		rows, err := tx.QueryContext(ctx, s.q(`SELECT seq, op, kind, episode, doc, created_ns FROM journal WHERE node = ? ORDER BY seq`), s.node())
		if err != nil {
			return s.wrap(err)
		}
		defer rows.Close()
		for rows.Next() {
			var (
				e       JournalEntry
				doc     string
				created int64
			)
			if err := rows.Scan(&e.Seq, &e.Op, &e.Kind, &e.Episode, &doc, &created); err != nil {
				return s.wrap(err)
			}
			if doc != "" {
				e.Doc = json.RawMessage(doc)
			}
			e.Created = time.Unix(0, created).UTC()
			out = append(out, e)
		}
		return s.wrap(rows.Err())
	})
	return out, err
}

// CloseJournal implements Store.
func (s *sqlStore) CloseJournal(ctx context.Context, op string, es []Episode) error {
	if op == "" {
		return errors.New("journal: close which operation? the name is empty")
	}
	docs, err := s.episodeDocs(es)
	if err != nil {
		return err
	}
	return s.tx(ctx, false, func(tx *sql.Tx) error {
		if err := s.putEpisodesTx(ctx, tx, es, docs); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, s.q(`DELETE FROM journal WHERE op = ? AND node = ?`), op, s.node())
		return s.wrap(err)
	})
}
