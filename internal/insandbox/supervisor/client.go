package supervisor

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// ErrNoSupervisor means the session directory has neither a live control
// socket nor a receipt.
var ErrNoSupervisor = errors.New("no supervisor")

// Call sends one request to the supervisor of session directory dir and
// returns its response. When the supervisor has already ended, Call answers
// from DIR/receipt.json: status reports state "exited", stop returns the
// receipt, and pause or continue are refused.
func Call(ctx context.Context, dir string, req Request) (*Response, error) {
	path := filepath.Join(dir, SocketFile)
	p, done, err := sockPath(path)
	if err != nil {
		return fromReceipt(dir, req, err)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", p)
	done()
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return fromReceipt(dir, req, err)
		}
		return nil, fmt.Errorf("connect to %s: %w", path, err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	} else if req.Op != OpStop {
		_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	}
	b, _ := json.Marshal(req)
	if _, err := c.Write(append(b, '\n')); err != nil {
		if peerGone(err) {
			// The supervisor ended between accepting and reading (it
			// writes its receipt before it closes its socket).
			return fromReceipt(dir, req, err)
		}
		return nil, fmt.Errorf("send to %s: %w", path, err)
	}
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		if len(line) == 0 && (req.Op == OpStop || peerGone(err)) {
			// The supervisor may have finished before answering; read the receipt.
			if r, rerr := fromReceipt(dir, req, err); rerr == nil {
				return r, nil
			}
		}
		return nil, fmt.Errorf("read reply from %s: %w", path, err)
	}
	var r Response
	if err := json.Unmarshal(line, &r); err != nil {
		return nil, fmt.Errorf("malformed reply from %s: %w", path, err)
	}
	return &r, nil
}

// peerGone reports whether err says the supervisor's end of the
// connection went away.
func peerGone(err error) bool {
	return errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF)
}

// ReadReceipt reads DIR/receipt.json.
func ReadReceipt(dir string) (*Receipt, error) {
	b, err := os.ReadFile(filepath.Join(dir, ReceiptFile))
	if err != nil {
		return nil, err
	}
	var rc Receipt
	if err := json.Unmarshal(b, &rc); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, ReceiptFile), err)
	}
	return &rc, nil
}

func fromReceipt(dir string, req Request, cause error) (*Response, error) {
	rc, err := ReadReceipt(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w in %s: no control socket (%v) and no %s", ErrNoSupervisor, dir, cause, ReceiptFile)
		}
		return nil, err
	}
	st := Status{State: StateExited, Mode: rc.Mode, Seq: rc.Seq, Identity: rc.Identity, Relaunches: rc.Relaunches, PausedTotal: rc.PausedTotal, Receipt: rc}
	switch req.Op {
	case OpStatus:
		return &Response{OK: true, Status: &st}, nil
	case OpStop:
		return &Response{OK: true, Receipt: rc}, nil
	}
	return &Response{
		Error:  fmt.Sprintf("%s %d refused: the supervisor in %s has exited (return code %s); see %s", req.Op, req.Seq, dir, codeText(rc.ReturnCode), ReceiptFile),
		Code:   CodeRefused,
		Status: &st,
	}, nil
}

func codeText(c *int) string {
	if c == nil {
		return "none: the harness never ran"
	}
	return fmt.Sprint(*c)
}
