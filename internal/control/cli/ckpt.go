package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/errdefs"
	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/home"
	"stasis/internal/storage/dburl"
	"stasis/internal/storage/store"
)

// snapshotFreer deletes snapshots that no checkpoint references any more;
// the sandbox providers set it. state is the stasis serve state directory
// whose providers hold them ("": $STASIS_HOME's providers); blobs is the
// shared blob store of the local and microvm providers' snapshots, or "".
var snapshotFreer func(ctx context.Context, refs []store.SnapshotRef, state, blobs string) error

func newCkptCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ckpt",
		Short: "List, show and delete the checkpoints in the record store",
		Long: `ckpt reads and prunes the record store, $STASIS_HOME/store.db
(~/.local/share/stasis/store.db when STASIS_HOME is unset).

A checkpoint is one record per episode: its provider, sandbox, snapshot, how
it was paused, and what a restore needs. Its state is one of:

  pending    a save is writing it, or a save was interrupted before it
             committed (a later save or a recovery marks it failed)
  committed  every record was durable and valid when it was committed; only
             committed checkpoints are restored
  failed     the save failed or was interrupted; the committed checkpoints
             before it are untouched

Every subcommand prints a table, or JSON with --json. Exit status: 0 done;
1 no such checkpoint, or another failure; 2 a usage error, or a refusal that
changed nothing.`,
		Example: `  stasis ckpt ls
  stasis ckpt show ckpt-000042
  stasis ckpt rm ckpt-000041 --json`,
	}
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON instead of a table")
	cmd.PersistentFlags().StringVar(&ckptStore, "store", "", "the record store: a postgres:// URL shared by the nodes of a cluster (default: $"+StoreEnv+", else $STASIS_HOME/store.db)")
	cmd.AddCommand(newCkptLsCmd(&asJSON), newCkptShowCmd(&asJSON), newCkptRmCmd(&asJSON), newCkptCreateCmd(&asJSON))
	return cmd
}

// ckptStore is ckpt's --store.
var ckptStore string

// ckptLocation is the record store ckpt was given: --store, or
// $STASIS_STORE ("": neither, the default SQLite file).
func ckptLocation() string {
	if ckptStore != "" {
		return ckptStore
	}
	return os.Getenv(StoreEnv)
}

// ckptSnapshotState is the state directory of the stasis serve whose
// SQLite record store ckpt works on: the file's directory, where that
// serve keeps its providers' snapshots (system.ProviderHome). It is ""
// for a cluster's PostgreSQL store, whose nodes keep their snapshots in
// the shared blob store (--blobs).
func ckptSnapshotState() (string, error) {
	loc := ckptLocation()
	if loc == "" {
		return home.Dir()
	}
	if dburl.IsPostgres(loc) {
		return "", nil
	}
	return filepath.Dir(loc), nil
}

// openCkptStore opens the record store ckpt works on: --store, or
// $STASIS_STORE, or the default SQLite file.
func openCkptStore(ctx context.Context) (store.Store, error) {
	loc := ckptLocation()
	if loc == "" {
		return store.Open(ctx)
	}
	return store.OpenAt(ctx, loc)
}

func newCkptCreateCmd(asJSON *bool) *cobra.Command {
	var stragglers string
	cmd := &cobra.Command{
		Use:   "create [ID]",
		Short: "Take a checkpoint over every live node of a cluster",
		Long: `create begins a checkpoint over every live node of the cluster on the
shared store (--store or $` + StoreEnv + `: the nodes are stasis serve --node
processes on it): each node pauses, snapshots and records its own episodes
and finishes its share, and the last one commits it. It waits until the
checkpoint is committed or failed (a node whose lease runs out fails it) and
prints each node's share. Without ID, one is made from the time.`,
		Example: `  stasis ckpt create --store postgres://stasis@db/stasis
  stasis ckpt create ckpt-000042 --json`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			loc := ckptLocation()
			if !dburl.IsPostgres(loc) {
				return ckptUsageError(cmd, *asJSON, fmt.Errorf("create takes a checkpoint over the nodes of a cluster: give the PostgreSQL store they share with --store postgres://… (or $%s); on one server, POST /v1/checkpoints to it", StoreEnv))
			}
			if err := coordinator.CheckStragglers(stragglers); err != nil {
				return ckptUsageError(cmd, *asJSON, fmt.Errorf("--%w", err))
			}
			id := "ckpt-" + time.Now().UTC().Format("20060102T150405Z")
			if len(args) == 1 {
				id = args[0]
			}
			st, err := store.OpenPostgres(cmd.Context(), loc)
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			defer st.Close()
			shares, err := cluster.CheckpointFrom(cmd.Context(), st, loc, id, stragglers)
			if *asJSON && err == nil {
				return writeJSON(cmd.OutOrStdout(), map[string]any{"checkpoint": id, "shares": shares})
			}
			if len(shares) > 0 {
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "NODE\tEPOCH\tSHARE\tRECORDS\tERROR")
				for _, sh := range shares {
					fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\n", sh.Node, sh.Epoch, sh.State, sh.Records, sh.Error)
				}
				_ = tw.Flush()
			}
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "checkpoint %s committed\n", id)
			return nil
		},
	}
	cmd.Flags().StringVar(&stragglers, "stragglers", "", "an episode a node cannot checkpoint: exclude or fail (default: each node's own policy)")
	return cmd
}

// ckptError turns a failure into an exit error, printing it as JSON on
// stdout too when --json is given.
func ckptError(cmd *cobra.Command, asJSON bool, err error) error {
	kind := "failed"
	switch errdefs.Kind(err) {
	case errdefs.ErrNotFound:
		kind = "not_found"
	case errdefs.ErrConflict, errdefs.ErrExists:
		kind = "refused"
	}
	if asJSON {
		_ = writeJSON(cmd.OutOrStdout(), map[string]string{"error": err.Error(), "code": kind})
	}
	return &exitError{Code: errdefs.ExitCode(err), Err: err}
}

func ckptUsageError(cmd *cobra.Command, asJSON bool, err error) error {
	if asJSON {
		_ = writeJSON(cmd.OutOrStdout(), map[string]string{"error": err.Error(), "code": "invalid"})
	}
	return &exitError{Code: 2, Err: err}
}

// ckptOneID accepts exactly one argument, the checkpoint id, and makes any
// other count a usage error (exit 2).
func ckptOneID(cmd *cobra.Command, args []string) error {
	if len(args) != 1 {
		return &exitError{Code: 2, Err: fmt.Errorf("%s takes one checkpoint id, got %d arguments: stasis ckpt %s ID (list them with stasis ckpt ls)", cmd.Name(), len(args), cmd.Name())}
	}
	return nil
}

func newCkptLsCmd(asJSON *bool) *cobra.Command {
	var (
		state string
		limit int
	)
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List checkpoints, newest first",
		Long: `ls lists the checkpoints in the record store, newest first: id, state,
creation time (UTC), the number of episode records, and why it failed.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch store.State(state) {
			case "", store.StatePending, store.StateCommitted, store.StateFailed:
			default:
				return ckptUsageError(cmd, *asJSON, fmt.Errorf("--state %q: use pending, committed or failed", state))
			}
			if limit < 0 {
				return ckptUsageError(cmd, *asJSON, fmt.Errorf("--limit %d: use a positive number, or 0 for all", limit))
			}
			st, err := openCkptStore(cmd.Context())
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			defer st.Close()
			cs, err := st.List(cmd.Context(), store.ListOptions{State: store.State(state), Limit: limit})
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			if *asJSON {
				if cs == nil {
					cs = []store.Checkpoint{}
				}
				_ = writeJSON(cmd.OutOrStdout(), cs)
				return nil
			}
			printCkptList(cmd.OutOrStdout(), cs)
			return nil
		},
	}
	cmd.Flags().StringVar(&state, "state", "", "only checkpoints in this state: pending, committed or failed")
	cmd.Flags().IntVar(&limit, "limit", 0, "at most this many (0: all)")
	return cmd
}

func ckptTime(t time.Time) string { return t.UTC().Format(time.RFC3339) }

func printCkptList(out io.Writer, cs []store.Checkpoint) {
	if len(cs) == 0 {
		fmt.Fprintln(out, "no checkpoints")
		return
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSTATE\tCREATED\tEPISODES\tERROR")
	for _, c := range cs {
		msg := c.Error
		if msg == "" {
			msg = "-"
		}
		if r := []rune(msg); len(r) > 80 {
			msg = string(r[:79]) + "…"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", c.ID, c.State, ckptTime(c.Created), c.Episodes, msg)
	}
	tw.Flush()
}

// ckptRestore says how a restore would continue the episode of a record.
func ckptRestore(r store.Record) string {
	switch {
	case r.Finished:
		return "finished"
	case r.RestoresInPlace():
		return "in-place"
	}
	return "relaunch"
}

func newCkptShowCmd(asJSON *bool) *cobra.Command {
	return &cobra.Command{
		Use:   "show ID",
		Short: "Show one checkpoint and its episode records",
		Long: `show prints a checkpoint and a table of its records: episode, provider,
snapshot, whether the snapshot keeps processes, the pause (sequence number and
mode), how a restore would continue the episode, and the attempt.

A restore continues an episode in place when its snapshot kept processes and
the record has the supervisor's identity and the pause clocks; otherwise it
relaunches the harness from the snapshot's files.

With --json it prints {"checkpoint": ..., "records": [...], "restore": {...}}:
the records are the stored documents, unknown fields included, and restore
maps each episode to in-place, relaunch or finished.`,
		Args: ckptOneID,
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := openCkptStore(cmd.Context())
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			defer st.Close()
			c, recs, err := st.Get(cmd.Context(), args[0])
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			if recs == nil {
				recs = []store.Record{}
			}
			if *asJSON {
				restore := map[string]string{}
				for _, r := range recs {
					restore[r.Episode] = ckptRestore(r)
				}
				_ = writeJSON(cmd.OutOrStdout(), map[string]any{"checkpoint": c, "records": recs, "restore": restore})
				return nil
			}
			printCkptShow(cmd.OutOrStdout(), c, recs)
			return nil
		},
	}
}

func printCkptShow(out io.Writer, c store.Checkpoint, recs []store.Record) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "id:\t%s\n", c.ID)
	fmt.Fprintf(tw, "state:\t%s\n", c.State)
	fmt.Fprintf(tw, "created:\t%s\n", ckptTime(c.Created))
	if c.Committed != nil {
		fmt.Fprintf(tw, "committed:\t%s\n", ckptTime(*c.Committed))
	}
	fmt.Fprintf(tw, "episodes:\t%d\n", c.Episodes)
	if c.Error != "" {
		fmt.Fprintf(tw, "error:\t%s\n", c.Error)
	}
	if len(c.Manifest) > 0 {
		fmt.Fprintf(tw, "manifest:\t%s\n", c.Manifest)
	}
	tw.Flush()
	if len(recs) == 0 {
		fmt.Fprintln(out, "\nno records")
		return
	}
	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "EPISODE\tPROVIDER\tSNAPSHOT\tKEEPS_PROCESSES\tPAUSE\tRESTORE\tATTEMPT")
	for _, r := range recs {
		snap := r.SnapshotID
		if snap == "" {
			snap = "-"
		}
		pause := "-"
		if r.PauseMode != "" || r.PauseSeq != 0 {
			pause = strconv.FormatInt(r.PauseSeq, 10) + "/" + r.PauseMode
			if !r.PauseConfirmed {
				pause += " (unconfirmed)"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%s\t%s\t%d\n", r.Episode, r.Provider, snap, r.KeepsProcesses, pause, ckptRestore(r), r.Attempt)
	}
	tw.Flush()
}

// ckptRmResult is what rm did, as --json prints it.
type ckptRmResult struct {
	Deleted string `json:"deleted"`
	// Unreferenced are the snapshots no remaining checkpoint references.
	Unreferenced []store.SnapshotRef `json:"unreferenced"`
	// SnapshotsDeleted says whether those snapshots were deleted.
	SnapshotsDeleted bool   `json:"snapshots_deleted"`
	Note             string `json:"note,omitempty"`
}

func newCkptRmCmd(asJSON *bool) *cobra.Command {
	var force bool
	var blobs string
	cmd := &cobra.Command{
		Use:   "rm ID",
		Short: "Delete a checkpoint and the snapshots only it referenced",
		Long: `rm deletes a checkpoint and its records from the record store, then deletes
the snapshots that no remaining checkpoint references (a snapshot shared with
another checkpoint, pending and failed ones included, is kept).

When no sandbox provider is available to this stasis, rm lists those
snapshots and says that they were not deleted.

A pending checkpoint is refused: a save may still be writing it. When you are
sure no save is running (it was interrupted), --force marks it failed and
deletes it.

The local and microvm providers' snapshots of a cluster are in the S3 store
its nodes share: give it with --blobs (or $` + BlobsEnv + `), as to stasis serve, so
that rm deletes them there (and collects their blobs once nothing uses them).`,
		Args: ckptOneID,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, id := cmd.Context(), args[0]
			st, err := openCkptStore(ctx)
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			defer st.Close()
			freed, err := st.Delete(ctx, id)
			if errors.Is(err, errdefs.ErrConflict) && force {
				if err = st.Fail(ctx, id, "marked failed by stasis ckpt rm --force"); err == nil {
					freed, err = st.Delete(ctx, id)
				}
			}
			if err != nil {
				return ckptError(cmd, *asJSON, err)
			}
			res := ckptRmResult{Deleted: id, Unreferenced: freed, SnapshotsDeleted: true}
			if res.Unreferenced == nil {
				res.Unreferenced = []store.SnapshotRef{}
			}
			var freeErr error
			if len(freed) > 0 {
				if snapshotFreer == nil {
					res.SnapshotsDeleted = false
					res.Note = "no sandbox provider is available to this stasis to delete the unreferenced snapshots: they still exist; delete them with their provider"
				} else if state, err := ckptSnapshotState(); err != nil {
					freeErr = err
					res.SnapshotsDeleted = false
					res.Note = fmt.Sprintf("the unreferenced snapshots were not deleted: %v; they still exist: delete them with their provider", err)
				} else if freeErr = snapshotFreer(ctx, freed, state, blobs); freeErr != nil {
					res.SnapshotsDeleted = false
					res.Note = fmt.Sprintf("deleting the unreferenced snapshots failed: %v; they may still exist: delete them with their provider", freeErr)
				}
			}
			out := cmd.OutOrStdout()
			if *asJSON {
				_ = writeJSON(out, res)
			} else {
				printCkptRm(out, res)
			}
			if freeErr != nil {
				return &exitError{Code: 1, Err: fmt.Errorf("checkpoint %q was deleted, but %s", id, res.Note)}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "delete a pending checkpoint too, marking it failed first: only when no save is writing it")
	cmd.Flags().StringVar(&blobs, "blobs", os.Getenv(BlobsEnv), "the S3 store of the local and microvm providers' snapshots, s3://BUCKET/PREFIX, as the nodes' stasis serve --blobs (default: $"+BlobsEnv+")")
	return cmd
}

func printCkptRm(out io.Writer, res ckptRmResult) {
	fmt.Fprintf(out, "deleted checkpoint %s\n", res.Deleted)
	if len(res.Unreferenced) == 0 {
		fmt.Fprintln(out, "no snapshot became unreferenced")
		return
	}
	refs := make([]string, len(res.Unreferenced))
	for i, r := range res.Unreferenced {
		refs[i] = "  " + r.String()
	}
	if res.SnapshotsDeleted {
		fmt.Fprintf(out, "deleted %d snapshots no checkpoint references any more:\n%s\n", len(refs), strings.Join(refs, "\n"))
		return
	}
	fmt.Fprintf(out, "%d snapshots are no longer referenced by any checkpoint and were NOT deleted:\n%s\n%s\n", len(refs), strings.Join(refs, "\n"), res.Note)
}
