package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/home"
	"stasis/internal/control/relay"
	"stasis/internal/control/serve"
	"stasis/internal/storage/atomicfile"
)

func newRelayCmd() *cobra.Command {
	var listen, upstream, tokenFile, logLevel string
	var heartbeat time.Duration
	cmd := &cobra.Command{
		Use:   "relay --listen ADDR --upstream URL --token-file FILE",
		Short: "Run the model relay alone (inside a sandbox, without a supervisor)",
		Long: `relay serves the OpenAI-compatible API a harness talks to (POST
/v1/chat/completions and POST /v1/responses, streamed or not, every other
POST under /v1 as a recorded call, the first two also without /v1; GET
/v1/models passed through) and forwards each call to the gateway with the
episode's token and attempt from FILE, which the harness never sees. It
stores and forwards: a response reaches the harness only once the relay
holds all of it, re-chunked as a stream when asked; a streaming client gets
its headers at once and an SSE comment every --heartbeat meanwhile. A
response counts as delivered only once all of it was written and flushed to
a live connection; a call whose client has gone is not sent upstream, or,
if it was, is recorded as abandoned. Upstream 429 and 5xx answers are
retried with backoff (Retry-After honoured).

Usually the relay runs inside the supervisor (stasis supervise
--relay-listen ...), where a pause holds it; alone it cannot be paused.
ADDR is host:port or unix:PATH; URL is http://, https:// or unix://PATH.
FILE is JSON: {"episode": "...", "token": "...", "attempt": N}.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := newLogger("text", logLevel)
			if err != nil {
				return &exitError{Code: 2, Err: err}
			}
			r, err := relay.New(relay.Config{Upstream: upstream, TokenFile: tokenFile, Heartbeat: heartbeat, Logger: log})
			if err != nil {
				return &exitError{Code: 2, Err: err}
			}
			return listenUntilSignal(cmd, "relay", listen, r.Handler(), log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8787", "address the harness calls")
	f.StringVar(&upstream, "upstream", "", "the gateway's URL")
	f.StringVar(&tokenFile, "token-file", "", "the episode's credentials (JSON)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.DurationVar(&heartbeat, "heartbeat", relay.DefaultHeartbeat, "interval of the SSE comments a streaming client gets while its response is stored or held")
	_ = cmd.MarkFlagRequired("upstream")
	_ = cmd.MarkFlagRequired("token-file")
	return cmd
}

// listenUntilSignal serves h on addr (the --listen flag) until a signal
// comes, having printed where name listens.
func listenUntilSignal(cmd *cobra.Command, name, addr string, h http.Handler, log *slog.Logger) error {
	ctx, stop := serve.OnSignal(cmd.Context())
	defer stop()
	ln, shown, err := serve.Listen(addr)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	fmt.Fprintln(cmd.OutOrStdout(), name+" listening on", shown)
	return serve.UntilSignal(ctx, ln, h, log)
}

func gatewayStateDir(flag string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	// $STASIS_HOME itself: episodes/ and ledgers/ sit beside the record
	// store, where `stasis ledger` looks.
	return home.Dir()
}

func newGatewayCmd() *cobra.Command {
	var listen, upstream, state, keyEnv, logLevel string
	cmd := &cobra.Command{
		Use:   "gateway --listen ADDR --upstream URL [--state DIR]",
		Short: "Run the host end of the relay: authenticate episodes, record the ledger, forward to the model",
		Long: `gateway is the host-side end of the model relay. Each episode has a bearer
token (stasis gateway episode add); a call with an unknown token is refused
(401), one from an older attempt is refused (409). Every response is appended
to the episode's ledger (STATE/ledgers) and flushed to disk before it is
answered (appends of episodes that wait at once share one flush); a
call id already in the ledger is answered from it without calling the model.
Metrics in Prometheus format at /metrics.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			serve.ProcsForFsync() // each ledger entry is fsync'd before its answer
			log, err := newLogger("text", logLevel)
			if err != nil {
				return &exitError{Code: 2, Err: err}
			}
			dir, err := gatewayStateDir(state)
			if err != nil {
				return err
			}
			g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: upstream, State: dir, ModelKey: os.Getenv(keyEnv), Logger: log})
			if err != nil {
				return &exitError{Code: 2, Err: err}
			}
			defer g.Close()
			return listenUntilSignal(cmd, "gateway", listen, g.Handler(), log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8788", "address relays call")
	f.StringVar(&upstream, "upstream", "", "the model server's URL")
	f.StringVar(&state, "state", "", "state directory: episodes/ and ledgers/ (default $STASIS_HOME)")
	f.StringVar(&keyEnv, "model-key-env", "STASIS_MODEL_KEY", "environment variable holding the model server's API key, if it needs one")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	_ = cmd.MarkFlagRequired("upstream")
	cmd.AddCommand(newGatewayEpisodeCmd())
	return cmd
}

func newGatewayEpisodeCmd() *cobra.Command {
	var state, tokenFile string
	var delivered, position, nextCall int64
	var inPlace, relaunch bool
	cmd := &cobra.Command{
		Use:   "episode (add EPISODE | restore EPISODE (--in-place --position N | --relaunch))",
		Short: "Register an episode, or start its next attempt after a restore",
		Long: `episode add EPISODE registers an episode and writes the credentials its
relay needs (to --token-file, or stdout). episode restore starts its next
attempt: --in-place cuts the ledger to position N, the pause's
relay_position (every response up to it was delivered or abandoned; an
acknowledgement from before relay_position existed gives relay_delivered,
pass it with --delivered); --relaunch makes the gateway match the relaunched harness's
first call against the ledger. The credentials are written again with the new
attempt; calls of older attempts are refused from now on.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir, err := gatewayStateDir(state)
			if err != nil {
				return err
			}
			g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: "http://unused.invalid", State: dir})
			if err != nil {
				return err
			}
			defer g.Close()
			var st relay.EpisodeState
			switch args[0] {
			case "add":
				st, err = g.AddEpisode(args[1])
			case "restore":
				if inPlace == relaunch {
					return &exitError{Code: 2, Err: errors.New("give exactly one of --in-place and --relaunch")}
				}
				if inPlace && cmd.Flags().Changed("position") == cmd.Flags().Changed("delivered") {
					return &exitError{Code: 2, Err: errors.New("restore --in-place needs exactly one of --position N (the pause's relay_position) and --delivered N (an older acknowledgement's relay_delivered)")}
				}
				if cmd.Flags().Changed("position") {
					delivered = position
				}
				st, err = g.Restore(args[1], inPlace, relay.LedgerAt{Position: delivered})
			default:
				return &exitError{Code: 2, Err: fmt.Errorf("unknown action %q: use add or restore", args[0])}
			}
			if err != nil {
				return &exitError{Code: 1, Err: err}
			}
			creds := st.Credentials(nextCall)
			if tokenFile != "" {
				return atomicfile.WriteJSON(tokenFile, creds, 0o600)
			}
			printJSON(cmd.OutOrStdout(), creds)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&state, "state", "", "the gateway's state directory (default $STASIS_HOME)")
	f.StringVar(&tokenFile, "token-file", "", "write the relay's credentials here (mode 0600) instead of stdout")
	f.BoolVar(&inPlace, "in-place", false, "restore: the snapshot kept the harness running")
	f.BoolVar(&relaunch, "relaunch", false, "restore: the harness is relaunched from its saved session")
	f.Int64Var(&position, "position", 0, "restore --in-place: the pause's relay_position, where the ledger is cut")
	f.Int64Var(&delivered, "delivered", 0, "restore --in-place: an acknowledgement without relay_position: its relay_delivered")
	f.Int64Var(&nextCall, "next-call", 0, "number the relaunched relay's first call (after the ledger's calls)")
	return cmd
}
