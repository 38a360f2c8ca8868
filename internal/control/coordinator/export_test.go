package coordinator

// ErrCrashed is in the error of an operation the step hook crashed.
var ErrCrashed = errCrashed
