"""systemone-onnx: decision models on onnxruntime. The code lives in export/, runtime/, models/, server/."""
