package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"stasis/internal/control/home"
	"stasis/internal/control/system"
	"stasis/internal/storage/ledger"
)

func newLedgerCmd() *cobra.Command {
	var (
		asJSON     bool
		dir, state string
	)
	cmd := &cobra.Command{
		Use:   "ledger",
		Short: "Show and verify an episode's token ledger",
		Long: `ledger reads the token ledgers the gateway writes: one append-only file per
episode, DIR/EPISODE.ledger ($STASIS_HOME/ledgers by default; a stasis serve
keeps them in STATE/gateway/ledgers, which --state STATE reads), holding every
model call the gateway forwarded — request, whole response, usage, token ids
and logprobs when the model server gave them.

Every line is a JSON record whose hash covers the line and the hash of the
line before it, so a changed, removed or reordered record is found. A restore
never rewrites the file: it appends a cut record, and the logical ledger (the
responses the harness has acted on, in order) is the entries up to the last
cut plus those appended after it. Settle records say what became of each
response: delivered to the harness, or abandoned (its client had gone). A
relaunched harness whose conversation did not match the ledger gets a broken
record: training must not trust that history.

Both subcommands only read; they take no lock and may run while a gateway
appends. Exit status: 0 done; 1 no such ledger, or another failure; 2 a usage
error, or a damaged ledger.`,
		Example: `  stasis ledger show ep1
  stasis ledger verify ep1 --json
  stasis ledger show ep1 --dir /var/lib/stasis/ledgers
  stasis ledger show ep1 --state /var/lib/stasis/serve`,
	}
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON instead of a table")
	cmd.PersistentFlags().StringVar(&dir, "dir", "", "the ledger directory (default $STASIS_HOME/ledgers)")
	cmd.PersistentFlags().StringVar(&state, "state", "", "read the ledgers of the stasis serve whose --state directory this is (STATE/gateway/ledgers; a cluster keeps them in its PostgreSQL store: read them through the API)")
	cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if state == "" {
			return nil
		}
		if dir != "" {
			return ledgerFail(cmd, asJSON, 2, "invalid", errors.New("give --dir or --state, not both"))
		}
		if st, err := os.Stat(state); err != nil || !st.IsDir() {
			return ledgerFail(cmd, asJSON, 2, "invalid", fmt.Errorf("--state %s: not a directory (a stasis serve --state directory)", state))
		}
		dir = system.LedgerDir(state)
		return nil
	}
	cmd.AddCommand(newLedgerShowCmd(&dir, &asJSON), newLedgerVerifyCmd(&dir, &asJSON))
	return cmd
}

// ledgerArgs checks for exactly one episode and resolves the directory.
func ledgerArgs(cmd *cobra.Command, args []string, dir *string, asJSON bool) (string, string, error) {
	if len(args) != 1 {
		return "", "", ledgerFail(cmd, asJSON, 2, "invalid", fmt.Errorf("%s takes one episode name, got %d arguments: stasis ledger %s EPISODE [--dir DIR]", cmd.Name(), len(args), cmd.Name()))
	}
	if _, err := ledger.Path(".", args[0]); err != nil {
		return "", "", ledgerFail(cmd, asJSON, 2, "invalid", err)
	}
	d := *dir
	if d == "" {
		var err error
		if d, err = home.Sub("ledgers"); err != nil {
			return "", "", ledgerFail(cmd, asJSON, 1, "failed", err)
		}
	}
	return args[0], d, nil
}

// ledgerFail turns a failure into an exit error, printing it as JSON on
// stdout too when --json is given.
func ledgerFail(cmd *cobra.Command, asJSON bool, code int, kind string, err error) error {
	if asJSON {
		_ = writeJSON(cmd.OutOrStdout(), map[string]string{"error": err.Error(), "code": kind})
	}
	return &exitError{Code: code, Err: err}
}

// ledgerReadError classifies an error of ledger.Read or ledger.Verify.
func ledgerReadError(cmd *cobra.Command, asJSON bool, episode, dir string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return ledgerFail(cmd, asJSON, 1, "not_found", fmt.Errorf("no ledger for episode %q in %s: check the episode name and --dir", episode, dir))
	case errors.Is(err, ledger.ErrCorrupt):
		return ledgerFail(cmd, asJSON, 2, "damaged", err)
	}
	return ledgerFail(cmd, asJSON, 1, "failed", err)
}

func newLedgerShowCmd(dir *string, asJSON *bool) *cobra.Command {
	return &cobra.Command{
		Use:   "show EPISODE",
		Short: "Print an episode's logical ledger, its cuts and broken marks",
		Long: `show prints the logical ledger of an episode — the calls its harness has
acted on, in order — as a table: sequence number, call id, attempt, start time
(UTC), duration in ms, prompt and completion tokens (from the usage, or the
token ids), whether the entry is a boundary (the first after a relaunch;
training masks it), its disposition and the start of its hash. The
disposition says whether the harness got the response: delivered, abandoned
(the client had gone and never saw it) or pending (not settled yet); in a
ledger written before dispositions were recorded (format 1) an entry not
settled reads as delivered. Below come the entries cuts dropped, with their
disposition (undelivered, unless settled before the cut), then the cuts and
broken marks, with the line of the file that holds them.

With --json it prints {"path", "episode", "format", "entries", "dropped",
"events", "total", "broken", "reason"}: entries and dropped are whole,
request, response and disposition included.
A damaged ledger is refused (exit 2): run stasis ledger verify for where.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			episode, d, err := ledgerArgs(cmd, args, dir, *asJSON)
			if err != nil {
				return err
			}
			h, err := ledger.Read(d, episode)
			if err != nil {
				return ledgerReadError(cmd, *asJSON, episode, d, err)
			}
			if *asJSON {
				_ = writeJSON(cmd.OutOrStdout(), h)
				return nil
			}
			printLedgerShow(cmd.OutOrStdout(), h)
			return nil
		},
	}
}

// ledgerTokens returns the prompt and completion token counts of an entry:
// from its usage (chat-completions or responses-API names), else from its
// token ids; "-" when unknown.
func ledgerTokens(e ledger.Entry) (string, string) {
	var u struct {
		Prompt     *int64 `json:"prompt_tokens"`
		Completion *int64 `json:"completion_tokens"`
		Input      *int64 `json:"input_tokens"`
		Output     *int64 `json:"output_tokens"`
	}
	_ = json.Unmarshal(e.Usage, &u)
	pick := func(a, b *int64, ids []int64) string {
		switch {
		case a != nil:
			return strconv.FormatInt(*a, 10)
		case b != nil:
			return strconv.FormatInt(*b, 10)
		case len(ids) > 0:
			return strconv.Itoa(len(ids))
		}
		return "-"
	}
	var pids, cids []int64
	if e.Tokens != nil {
		pids, cids = e.Tokens.PromptIDs, e.Tokens.CompletionIDs
	}
	return pick(u.Prompt, u.Input, pids), pick(u.Completion, u.Output, cids)
}

// dispositionCounts says how many entries have each disposition, in a
// fixed order: "2 delivered, 1 abandoned".
func dispositionCounts(es []ledger.Entry) string {
	n := map[ledger.Disposition]int{}
	for _, e := range es {
		n[e.Disposition]++
	}
	var parts []string
	for _, d := range []ledger.Disposition{ledger.Delivered, ledger.Abandoned, ledger.Pending, ledger.Undelivered} {
		if n[d] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[d], d))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// printLedgerEntries prints entries as a table, one row each.
func printLedgerEntries(out io.Writer, es []ledger.Entry) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tCALL ID\tATTEMPT\tSTARTED\tMS\tPROMPT TOK\tCOMPLETION TOK\tBOUNDARY\tDISPOSITION\tHASH")
	for _, e := range es {
		started, ms := "-", "-"
		if !e.Started.IsZero() {
			started = e.Started.UTC().Format("2006-01-02T15:04:05.000Z")
			if !e.Finished.IsZero() {
				ms = strconv.FormatInt(e.Finished.Sub(e.Started).Milliseconds(), 10)
			}
		}
		pt, ct := ledgerTokens(e)
		b := "-"
		if e.Boundary {
			b = "yes"
		}
		d := string(e.Disposition)
		if d == "" {
			d = "-"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%.12s\n", e.Seq, e.CallID, e.Attempt, started, ms, pt, ct, b, d, e.Hash)
	}
	tw.Flush()
}

func printLedgerShow(out io.Writer, h ledger.History) {
	state := "intact"
	if h.Broken {
		state = "BROKEN: " + h.Reason
	}
	fmt.Fprintf(out, "ledger %s (%s, format %d)\n%d live entries (%s), %d recorded, %d dropped by cuts, %d events; history %s\n",
		h.Episode, h.Path, h.Format, len(h.Entries), dispositionCounts(h.Entries), h.Total, len(h.Dropped), len(h.Events), state)
	if len(h.Entries) > 0 {
		fmt.Fprintln(out)
		printLedgerEntries(out, h.Entries)
	}
	if len(h.Dropped) > 0 {
		fmt.Fprintf(out, "\ndropped by cuts (%s):\n", dispositionCounts(h.Dropped))
		printLedgerEntries(out, h.Dropped)
	}
	if len(h.Events) > 0 {
		fmt.Fprintln(out, "\nevents:")
		for _, ev := range h.Events {
			at := ev.At.UTC().Format("2006-01-02T15:04:05Z")
			switch ev.Kind {
			case "cut":
				note := ""
				if ev.Boundary {
					note = "; the next entry is a boundary"
				}
				fmt.Fprintf(out, "  line %d, %s: cut %d -> %d entries: %s%s\n", ev.Line, at, ev.From, ev.To, ev.Reason, note)
			default:
				fmt.Fprintf(out, "  line %d, %s: %s at %d entries: %s\n", ev.Line, at, ev.Kind, ev.From, ev.Reason)
			}
		}
	}
	if h.TornBytes > 0 {
		fmt.Fprintf(out, "\nthe last %d bytes are an unfinished append (a crash or an append under way): ignored; the next append removes them\n", h.TornBytes)
	}
}

func newLedgerVerifyCmd(dir *string, asJSON *bool) *cobra.Command {
	return &cobra.Command{
		Use:   "verify EPISODE",
		Short: "Check every hash and parent link of an episode's ledger",
		Long: `verify walks the whole ledger file of an episode: every record must parse,
its hash must cover it, its parent must be the hash of the record before it,
entry sequence numbers must follow the logical ledger, and cuts must stay
within it, and settle records must name live entries by seq and call id
and never change a disposition. It prints OK with the counts — records,
entries (live ones among them), cuts, and entries by disposition: delivered,
abandoned, pending (not settled yet) and undelivered (dropped by a cut
before being settled) — or the first bad record: its line, its sequence
number, and what is wrong.

A history marked broken (a relaunch that did not match) is reported but is
not a verify failure: the file is intact. An unfinished last line (a crash in
the middle of an append, never acknowledged) is reported and ignored.

Exit status: 0 intact; 2 damaged (or a usage error); 1 no such ledger, or
another failure. --json prints the report: {"path", "episode", "format",
"ok", "bad": {"line", "seq", "kind", "what"}, "records", "entries", "live",
"cuts", "broken", "broken_reason", "head", "delivered", "abandoned",
"pending", "undelivered", "torn_bytes"}.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			episode, d, err := ledgerArgs(cmd, args, dir, *asJSON)
			if err != nil {
				return err
			}
			rep, err := ledger.Verify(d, episode)
			if err != nil {
				return ledgerReadError(cmd, *asJSON, episode, d, err)
			}
			out := cmd.OutOrStdout()
			if *asJSON {
				_ = writeJSON(out, rep)
			} else {
				printLedgerVerify(out, rep)
			}
			if !rep.OK {
				return &exitError{Code: 2, Err: fmt.Errorf("ledger %s is damaged at %s: restore the file from a copy or discard the episode", rep.Path, rep.Bad)}
			}
			return nil
		},
	}
}

func printLedgerVerify(out io.Writer, rep ledger.Report) {
	counts := fmt.Sprintf("%d records, %d entries (%d live), %d cuts; %d delivered, %d abandoned, %d pending, %d undelivered",
		rep.Records, rep.Entries, rep.Live, rep.Cuts, rep.Delivered, rep.Abandoned, rep.Pending, rep.Undelivered)
	if rep.OK {
		fmt.Fprintf(out, "OK %s: %s, head %.12s\n", rep.Path, counts, rep.Head)
	} else {
		fmt.Fprintf(out, "FAILED %s: %s\n  before it: %s\n", rep.Path, rep.Bad, counts)
	}
	if rep.Broken {
		fmt.Fprintf(out, "history marked broken: %s\n", rep.BrokenReason)
	}
	if rep.TornBytes > 0 {
		fmt.Fprintf(out, "the last %d bytes are an unfinished append: ignored\n", rep.TornBytes)
	}
}
