package sandboxcli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/insandbox/supervisor"
)

func newCtlCmd() *cobra.Command {
	var (
		dir  string
		wait time.Duration
	)
	cmd := &cobra.Command{
		Use:   "ctl --dir DIR (pause N | continue N | status | stop)",
		Short: "Send a control command to a supervisor and print its JSON reply",
		Long: `ctl speaks to the supervisor serving DIR/control.sock and prints one JSON
document on stdout. The host runs exactly this through a provider's exec API.

  pause N     pause the harness; N must be above every earlier pause.
              Repeating the pause in force returns the same acknowledgement.
  continue N  continue the pause in force (N must name it); repeating a
              continue already done returns its acknowledgement.
  status      state (running, paused, stopping, exited), mode, last seq,
              identity, harness pid, relaunches, deadline left, time paused.
  stop        end the harness gracefully, as at the deadline; prints the
              receipt.

--wait D retries for up to D while no supervisor answers (one that is still
starting), so a host needs one exec rather than a polling loop.

Exit status: 0 done; 2 refused or malformed (nothing changed; the JSON says
the supervisor's state); 1 no supervisor reachable or another failure.`,
		Example: `  stasis ctl --dir /tmp/ep1 pause 1
  stasis ctl --dir /tmp/ep1 continue 1
  stasis ctl --dir /tmp/ep1 status`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if dir == "" {
				return &exitError{Code: 2, Err: errors.New("--dir is required: the supervisor's session directory")}
			}
			req, err := ctlRequest(args)
			if err != nil {
				return &exitError{Code: 2, Err: err}
			}
			return runCtl(cmd, dir, req, wait)
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "the supervisor's session directory")
	cmd.Flags().DurationVar(&wait, "wait", 0, "retry for up to this long while no supervisor answers")
	return cmd
}

func ctlRequest(args []string) (supervisor.Request, error) {
	op := args[0]
	switch op {
	case supervisor.OpPause, supervisor.OpContinue:
		if len(args) != 2 {
			return supervisor.Request{}, fmt.Errorf("%s needs a sequence number: stasis ctl --dir DIR %s N", op, op)
		}
		n, err := strconv.ParseInt(args[1], 10, 64)
		if err != nil || n <= 0 {
			return supervisor.Request{}, fmt.Errorf("%s: sequence number %q must be a positive integer", op, args[1])
		}
		return supervisor.Request{Op: op, Seq: n}, nil
	case supervisor.OpStatus, supervisor.OpStop:
		if len(args) != 1 {
			return supervisor.Request{}, fmt.Errorf("%s takes no argument", op)
		}
		return supervisor.Request{Op: op}, nil
	}
	return supervisor.Request{}, fmt.Errorf("unknown command %q: use pause N, continue N, status or stop", op)
}

func runCtl(cmd *cobra.Command, dir string, req supervisor.Request, wait time.Duration) error {
	out := cmd.OutOrStdout()
	print := func(v any) {
		b, _ := json.MarshalIndent(v, "", "  ")
		fmt.Fprintln(out, string(b))
	}
	r, err := supervisor.Call(context.Background(), dir, req)
	for deadline := time.Now().Add(wait); err != nil && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond) // poll interval, bounded by --wait
		r, err = supervisor.Call(context.Background(), dir, req)
	}
	if err != nil {
		print(map[string]string{"error": err.Error(), "code": supervisor.CodeUnreachable})
		return &exitError{Code: 1, Err: err}
	}
	if !r.OK {
		doc := map[string]any{"error": r.Error, "code": r.Code}
		if r.Status != nil {
			doc["status"] = r.Status
		}
		print(doc)
		code := 1
		if r.Code == supervisor.CodeRefused || r.Code == supervisor.CodeInvalid {
			code = 2
		}
		return &exitError{Code: code, Err: errors.New(r.Error)}
	}
	switch {
	case r.Ack != nil:
		print(r.Ack)
	case r.Status != nil:
		print(r.Status)
	case r.Receipt != nil:
		print(r.Receipt)
	default:
		print(r)
	}
	return nil
}
